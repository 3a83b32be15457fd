package lease

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/internal/promtext"
)

// maxLeases bounds the Leases a Counter tracks: a selector that matches
// far more than any set of server replicas is a mistake, and the map must
// not grow without bound.
const maxLeases = 10000

// CounterConfig configures an agent's Counter.
type CounterConfig struct {
	Client   *Client
	Selector Selector

	// PollInterval is how long to wait before listing again when a watch
	// cannot be opened or breaks (with a watch that works, changes arrive
	// as they happen). Default 10s.
	PollInterval time.Duration
	// WatchTimeout is how long one watch runs before it is renewed; each
	// watch takes a random length between it and twice it, as client-go's
	// reflector does. Default 5m.
	WatchTimeout time.Duration

	// OnChange is called with the new count of valid Leases (at least 1,
	// as upstream) whenever it changes, from the Counter's goroutine.
	OnChange func(n int)

	Metrics *promtext.Registry // nil: a private registry
	Logger  *slog.Logger
	Now     func() time.Time // default time.Now
}

// Counter counts the valid server Leases matching a selector: it lists
// them, then follows a watch, and recounts when the first counted Lease
// runs out (an expiry produces no watch event).
type Counter struct {
	cfg      CounterConfig
	log      *slog.Logger
	metrics  *agentMetrics
	listLog  stateLog
	watchLog stateLog

	// Owned by Run's goroutine.
	leases              map[string]*Lease // matching Leases by name
	reported            int               // last count given to OnChange; 0 before the first
	lastList, lastWatch time.Time         // when each call was last started (see pace)

	mu    sync.Mutex
	count int // guarded by mu; 0 until the first successful list
}

// NewCounter returns a Counter that is not yet running.
func NewCounter(cfg CounterConfig) (*Counter, error) {
	if cfg.Client == nil {
		return nil, errors.New("lease counter: no client")
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = 10 * time.Second
	}
	if cfg.WatchTimeout <= 0 {
		cfg.WatchTimeout = 5 * time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.OnChange == nil {
		cfg.OnChange = func(int) {}
	}
	log := cfg.Logger.With("lease_namespace", cfg.Client.Namespace(), "lease_selector", cfg.Selector.String())
	return &Counter{
		cfg:      cfg,
		log:      log,
		metrics:  newAgentMetrics(cfg.Metrics),
		listLog:  stateLog{log: log, what: "count server leases"},
		watchLog: stateLog{log: log, what: "watch server leases (listing again every poll interval instead)"},
		leases:   map[string]*Lease{},
	}, nil
}

// Count is the number of valid Leases (at least 1), or 0 when no list has
// succeeded yet.
func (c *Counter) Count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.count
}

// Run counts until ctx ends.
func (c *Counter) Run(ctx context.Context) {
	for ctx.Err() == nil {
		rv, err := c.list(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			c.listLog.failed(err)
			// Without the apiserver, go on counting what was last seen:
			// Leases that run out stop counting, as with upstream's cache.
			if c.reported != 0 {
				c.recount()
			}
			if !kubeapi.Sleep(ctx, kubeapi.Jitter(c.cfg.PollInterval, 0.1)) {
				return
			}
			continue
		}
		c.listLog.ok("servers", c.Count())
		// Follow the list with watches until one cannot continue from
		// where the last ended; then list again, at once or after a pause.
		next := watchAgain
		for next == watchAgain && ctx.Err() == nil {
			rv, next = c.watch(ctx, rv)
		}
		if next == listLater && !kubeapi.Sleep(ctx, kubeapi.Jitter(c.cfg.PollInterval, 0.1)) {
			return
		}
	}
}

// What follows a watch.
const (
	watchAgain = iota // the watch ran its time: continue from its last resourceVersion
	listNow           // the resourceVersion is too old, or a Lease ran out: list again at once
	listLater         // the watch failed: list again after PollInterval
)

// minCallGap keeps list and watch calls at least this far apart each, so
// an apiserver that ends every watch at once, or answers every watch with
// 410, is not called in a tight loop.
const minCallGap = time.Second

func (c *Counter) list(ctx context.Context) (string, error) {
	if !kubeapi.Pace(ctx, &c.lastList, minCallGap) {
		return "", ctx.Err()
	}
	lctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	start := time.Now()
	leases, rv, err := c.cfg.Client.List(lctx, c.cfg.Selector.String())
	c.metrics.observeList(err, time.Since(start))
	if err != nil {
		return "", err
	}
	if len(leases) > maxLeases {
		return "", fmt.Errorf("%d server leases match; more than %d is not a konnectivity deployment (check --lease-label-selector)", len(leases), maxLeases)
	}
	clear(c.leases)
	for _, l := range leases {
		if c.cfg.Selector.Matches(l.Labels) {
			c.leases[l.Name] = l
		}
	}
	c.recount()
	return rv, nil
}

// watch follows one watch from rv. It returns the resourceVersion to go on
// from and what to do next.
//
// When a counted Lease runs out the watch ends for a new list, which
// recounts: a Lease expires without an event, and the list tells a server
// that stopped renewing from a watch that silently stopped delivering
// renewals (without a list, the count drops then anyway).
func (c *Counter) watch(ctx context.Context, rv string) (string, int) {
	if !kubeapi.Pace(ctx, &c.lastWatch, minCallGap) {
		return rv, listLater
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	timeout := c.cfg.WatchTimeout + time.Duration(rand.Int64N(int64(c.cfg.WatchTimeout)))
	events, werr, err := c.cfg.Client.Watch(wctx, c.cfg.Selector.String(), rv, timeout)
	c.metrics.observeWatch(err)
	if err != nil {
		if ctx.Err() == nil && !kubeapi.IsCode(err, http.StatusGone) {
			c.watchLog.failed(err)
		}
		if kubeapi.IsCode(err, http.StatusGone) {
			return rv, listNow
		}
		return rv, listLater
	}
	c.watchLog.ok()
	// Drain the channel on the way out so the watch's reader ends.
	defer func() {
		cancel()
		for range events {
		}
	}()
	expiry := time.NewTimer(time.Hour)
	defer expiry.Stop()
	for {
		c.armExpiry(expiry)
		select {
		case <-ctx.Done():
			return rv, listLater
		case <-expiry.C:
			return rv, listNow
		case ev, open := <-events:
			if !open {
				err := werr()
				switch {
				case err == nil:
					return rv, watchAgain
				case kubeapi.IsCode(err, http.StatusGone):
					return rv, listNow
				default:
					c.watchLog.failed(err)
					return rv, listLater
				}
			}
			rv = ev.ResourceVersion
			if ev.Lease != nil {
				if _, known := c.leases[ev.Lease.Name]; !known && ev.Type != "DELETED" && len(c.leases) >= maxLeases {
					c.watchLog.failed(fmt.Errorf("more than %d server leases match (check --lease-label-selector)", maxLeases))
					return rv, listLater
				}
				if ev.Type == "DELETED" || !c.cfg.Selector.Matches(ev.Lease.Labels) {
					delete(c.leases, ev.Lease.Name)
				} else {
					c.leases[ev.Lease.Name] = ev.Lease
				}
				c.recount()
			}
		}
	}
}

// armExpiry sets t to fire when the first counted Lease runs out.
func (c *Counter) armExpiry(t *time.Timer) {
	now := c.cfg.Now()
	next := time.Duration(-1)
	for _, l := range c.leases {
		if exp, ok := l.Expiry(); ok && exp.After(now) {
			if d := exp.Sub(now); next < 0 || d < next {
				next = d
			}
		}
	}
	if next < 0 {
		next = time.Hour
	}
	t.Reset(next + time.Millisecond) // strictly after the expiry
}

// recount counts the valid Leases and reports a change.
func (c *Counter) recount() {
	now := c.cfg.Now()
	n := 0
	for _, l := range c.leases {
		if l.Valid(now) {
			n++
		}
	}
	if n == 0 {
		n = 1 // as upstream: there is at least the server that answered
	}
	c.mu.Lock()
	c.count = n
	c.mu.Unlock()
	if n != c.reported {
		if c.reported != 0 {
			// The user of the count logs what it changes.
			c.log.Debug("server lease count changed", "servers", n, "was", c.reported)
		} else {
			c.log.Info("counting server leases", "servers", n)
		}
		c.reported = n
		c.cfg.OnChange(n)
	}
}
