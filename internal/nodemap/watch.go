package nodemap

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/internal/kubeclient"
)

// Config says what a Watcher follows.
type Config struct {
	REST *kubeclient.Config

	// Node, when set, narrows the Watcher to one node: its Node object and
	// the Pods placed on it (an agent's view of its own node). Empty: every
	// Node and EndpointSlice (a server's view).
	Node string
	// Pods also learns pod addresses from Pods (status.podIPs on
	// spec.nodeName), for CNIs whose pod addresses are outside the Nodes'
	// podCIDRs and pods no Service selects. Always on with Node set.
	Pods bool

	// MinBackoff and MaxBackoff bound the wait before listing again after
	// an error; it doubles on each failure in a row. Defaults 1s and 30s.
	MinBackoff, MaxBackoff time.Duration
	// WatchTimeout is how long one watch runs before it is renewed; each
	// takes a random length between it and twice it. Default 5m.
	WatchTimeout time.Duration

	Logger *slog.Logger
}

// Watcher keeps a Table of the apiserver's view of nodes: it lists Nodes
// and EndpointSlices (or, for one node, its Node and its Pods) and
// follows them with watches, listing again when a watch cannot continue
// (410 Gone) and backing off on errors. An apiserver that cannot be
// reached, or RBAC that forbids a kind, is one warning per kind and
// state, never a crash: the table keeps what it last knew.
type Watcher struct {
	cfg   Config
	table *Table
	log   *slog.Logger
	api   *kubeclient.Client // shared by the followers; its idle connections end with Run
	kinds []*follower
}

// follower lists and watches one kind. Its fields are owned by the
// goroutine that runs it (Watcher.Run starts one per kind), except synced,
// which Synced reads from any goroutine, and log, which SetLogger may
// replace before Run.
type follower struct {
	w         *Watcher
	c         client
	log       *slog.Logger
	state     string // the last failure logged ("" when working)
	full      bool   // a table-full warning was logged since the last list
	synced    atomic.Bool
	minGap    time.Duration // least time between two lists, and between two watches
	lastList  time.Time     // when the last list started
	lastWatch time.Time     // when the last watch started
}

// New returns a Watcher that is not yet running.
func New(cfg Config) (*Watcher, error) {
	if cfg.REST == nil {
		return nil, errors.New("node map: no apiserver config")
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = time.Second
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(30*time.Second, cfg.MinBackoff)
	}
	if cfg.WatchTimeout <= 0 {
		cfg.WatchTimeout = 5 * time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	api := kubeclient.New(cfg.REST)
	w := &Watcher{cfg: cfg, table: NewTable(), log: cfg.Logger, api: api}
	add := func(k kindID, selector string) {
		w.kinds = append(w.kinds, &follower{
			w:      w,
			c:      client{api: api, kind: k, fieldSelector: selector, page: listPage},
			log:    w.log.With("kind", k.String()),
			minGap: min(time.Second, cfg.MinBackoff),
		})
	}
	if cfg.Node != "" {
		add(kindNodes, "metadata.name="+cfg.Node)
		add(kindPods, "spec.nodeName="+cfg.Node)
		return w, nil
	}
	add(kindNodes, "")
	add(kindSlices, "")
	if cfg.Pods {
		add(kindPods, "")
	}
	return w, nil
}

// SetLogger replaces the logger New was given; call it before Run.
func (w *Watcher) SetLogger(l *slog.Logger) {
	w.log = l
	for _, f := range w.kinds {
		f.log = l.With("kind", f.c.kind.String())
	}
}

// Table is the table the Watcher keeps; lookups may start before Run.
func (w *Watcher) Table() *Table { return w.table }

// NodeOf names the node that owns host, or "" (Table.Lookup); loaded is
// false until every kind has been listed once.
func (w *Watcher) NodeOf(host string) (node string, loaded bool) {
	n, _ := w.table.Lookup(host)
	return n, w.Synced()
}

// Synced reports whether every kind has been listed at least once.
func (w *Watcher) Synced() bool {
	for _, f := range w.kinds {
		if !f.synced.Load() {
			return false
		}
	}
	return true
}

// Run follows every kind until ctx ends; it returns when all its
// goroutines have.
func (w *Watcher) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, f := range w.kinds {
		wg.Go(func() { f.run(ctx) })
	}
	wg.Wait()
	w.api.CloseIdleConnections()
}

func (f *follower) run(ctx context.Context) {
	backoff := f.w.cfg.MinBackoff
	for ctx.Err() == nil {
		rv, err := f.list(ctx)
		if err == nil {
			f.ok()
			backoff = f.w.cfg.MinBackoff
			err = f.watchFrom(ctx, rv)
		}
		if ctx.Err() != nil {
			return
		}
		if kubeapi.IsCode(err, http.StatusGone) {
			continue // too old to continue from: list again at once
		}
		f.failed(err)
		if !kubeapi.Sleep(ctx, kubeapi.Jitter(backoff, 0.1)) {
			return
		}
		backoff = min(2*backoff, f.w.cfg.MaxBackoff)
	}
}

// list reads the whole collection page by page into the table, then drops
// the objects the table holds that the list no longer has.
func (f *follower) list(ctx context.Context) (string, error) {
	if !kubeapi.Pace(ctx, &f.lastList, f.minGap) {
		return "", ctx.Err()
	}
	seen := map[string]struct{}{}
	f.full = false
	var head listHead
	for {
		lctx, cancel := context.WithTimeout(ctx, time.Minute)
		var err error
		head, err = f.c.listPage(lctx, head.Continue, func(item []byte) error {
			r, err := f.c.kind.decode(item)
			if err != nil {
				return err
			}
			seen[r.key] = struct{}{}
			f.apply(r)
			return nil
		})
		cancel()
		if err != nil {
			return "", err
		}
		if head.Continue == "" {
			break
		}
	}
	for _, key := range f.w.table.keys(f.c.kind) {
		if _, ok := seen[key]; !ok {
			f.remove(key)
		}
	}
	if !f.synced.Swap(true) {
		nodes, pods := f.w.table.Size()
		f.log.Info("node map listed", "nodes", nodes, "pod_addresses", pods)
	}
	return head.ResourceVersion, nil
}

// watchFrom follows watches from rv until one fails; a watch the apiserver
// ends on time is renewed from the last resourceVersion seen.
func (f *follower) watchFrom(ctx context.Context, rv string) error {
	for {
		if !kubeapi.Pace(ctx, &f.lastWatch, f.minGap) {
			return ctx.Err()
		}
		timeout := f.w.cfg.WatchTimeout + time.Duration(rand.Int64N(int64(f.w.cfg.WatchTimeout)))
		// The apiserver ends the watch at timeout; the deadline is a
		// backstop against one that never does.
		wctx, cancel := context.WithTimeout(ctx, timeout+30*time.Second)
		var err error
		rv, err = f.watchOnce(wctx, rv, timeout)
		cancel()
		if err != nil {
			return err
		}
	}
}

func (f *follower) watchOnce(ctx context.Context, rv string, timeout time.Duration) (string, error) {
	ws, err := f.c.watch(ctx, rv, timeout)
	if err != nil {
		return rv, err
	}
	defer ws.close()
	for {
		ev, err := ws.next()
		if err != nil {
			if errors.Is(err, io.EOF) || (ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded)) {
				return rv, nil
			}
			return rv, err
		}
		if ev.rec.rv != "" {
			rv = ev.rec.rv
		}
		if ev.typ == "DELETED" {
			f.remove(ev.rec.key)
		} else if ev.typ != "BOOKMARK" {
			f.apply(ev.rec)
		}
	}
}

// apply puts one object in the table.
func (f *follower) apply(r record) {
	t := f.w.table
	if f.c.kind == kindNodes {
		if !t.setNode(r.node) {
			f.tableFull("nodes", maxNodes)
		}
		return
	}
	if len(r.claims) == 0 {
		t.dropClaims(f.c.kind.source(), r.key)
		return
	}
	if t.setClaims(f.c.kind.source(), r.key, r.claims) > 0 {
		f.tableFull("pod addresses", maxPodAddrs)
	}
}

func (f *follower) remove(key string) {
	if f.c.kind == kindNodes {
		f.w.table.deleteNode(key)
		return
	}
	f.w.table.dropClaims(f.c.kind.source(), key)
}

func (f *follower) tableFull(what string, limit int) {
	if !f.full {
		f.full = true
		f.log.Warn(fmt.Sprintf("node map full: more than %d %s; the rest are not routed by node", limit, what))
	}
}

// failed logs a failure once per state: an unreachable apiserver, missing
// RBAC or a broken answer is one warning until it changes or recovers.
func (f *follower) failed(err error) {
	state, hint := classify(err, f.c.kind)
	if state == f.state {
		return
	}
	f.state = state
	f.log.Warn("node map: "+hint+"; retrying with back-off", "err", err)
}

func (f *follower) ok() {
	if f.state != "" {
		f.state = ""
		f.log.Info("node map: apiserver answers again")
	}
}

// classify names the state an error puts the follower in and what it means.
func classify(err error, k kindID) (state, hint string) {
	var ae *kubeapi.Error
	var ne net.Error
	switch {
	case errors.As(err, &ae) && ae.Code == http.StatusForbidden:
		return "forbidden", fmt.Sprintf("may not list and watch %s (RBAC: grant list and watch on %s)", k, k)
	case errors.As(err, &ae) && ae.Code == http.StatusUnauthorized:
		return "unauthorized", "the apiserver does not accept the credential"
	case errors.As(err, &ae):
		return fmt.Sprintf("http %d", ae.Code), fmt.Sprintf("cannot list or watch %s", k)
	case errors.As(err, &ne):
		return "unreachable", "apiserver unreachable"
	}
	return "broken", fmt.Sprintf("cannot read %s", k)
}
