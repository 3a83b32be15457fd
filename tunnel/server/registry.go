package server

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// Strategy is one way of choosing an agent for a dial; the server tries its
// strategies in order and uses the first that finds an agent.
type Strategy string

const (
	StrategyDefault      Strategy = "default"      // any agent, spread round-robin
	StrategyDestHost     Strategy = "destHost"     // the agent whose identifiers name the destination host
	StrategyDefaultRoute Strategy = "defaultRoute" // agents that advertised default-route=true
	StrategyNode         Strategy = "node"         // the agent bound to the node the apiserver says owns the destination
)

// ParseStrategies parses upstream's --proxy-strategies list.
func ParseStrategies(s string) ([]Strategy, error) {
	var out []Strategy
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		switch Strategy(part) {
		case StrategyDefault, StrategyDestHost, StrategyDefaultRoute, StrategyNode:
			out = append(out, Strategy(part))
		case "":
		default:
			return nil, fmt.Errorf("unknown proxy strategy %q (want default, destHost, defaultRoute or node)", part)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no proxy strategy given")
	}
	return out, nil
}

// agentConn is one agent's connection to this server, our agent's or an
// upstream agent's: what opens its tunnels is its opener, and nothing here
// asks which kind it is.
type agentConn struct {
	// Immutable once registered.
	id          string
	claimedID   string // the ID the agent asked for, when its credential gave it id instead (checkIdentity); "" otherwise
	ids         wire.Identifiers
	remote      string
	since       time.Time
	opener      tunnelOpener // its own locks
	conn        *wire.WatchedConn
	stopControl context.CancelFunc // ends the control stream, which would hold a graceful shutdown open
	principal   Principal          // what the agent's credential proves; fixed at login
	cred        *connCredential    // the credential the connection stands on; its own lock
	canPause    bool               // it can hold its tunnels across a server restart (our agents only); fixed at login
	node        string             // the node its credential binds it to (boundNode); "" for none
	credKey     string             // its credential and address (credKey), counted against MaxAgentsPerCredential

	// Atomic: any goroutine.
	tunnels            atomic.Int64 // open tunnels
	draining           atomic.Bool  // the agent announced a drain
	restarting         atomic.Bool  // the agent announced a restart in place: its paused tunnels wait for its next link (agent_restart.go)
	doubted            atomic.Bool  // its token's last review was negative: it takes no new tunnel (identity.go, reviewLink)
	quiet              atomic.Bool  // its login or end is a replacement in a run (replaced.go): not logged one by one
	bytesTo, bytesFrom atomic.Int64
}

// tunnelOpener is the side of an agent's connection that opens its
// tunnels: our agent's link (linkOpener) or an upstream agent's Packet
// stream (upstreamAgent).
type tunnelOpener interface {
	// roundTrip opens one tunnel: an HTTP/2 CONNECT stream, or a dial on
	// an upstream agent's Packet stream.
	roundTrip(req *http.Request) (*http.Response, error)
	// takesNew reports whether it takes a new tunnel now. A dial asks it
	// of many agents: it allocates nothing, and our link's answer is an
	// atomic it keeps.
	takesNew() bool
	// shutdown takes no new tunnel (GOAWAY) and waits for the open ones
	// to end, or for ctx; then the connection ends.
	shutdown(ctx context.Context)
	// close ends the connection and its tunnels at once.
	close()
	// probe asks the agent's connection for a sign of life when it has
	// read nothing since since, and closes it unless one comes within
	// wait (h2link.Probe).
	probe(since time.Time, wait time.Duration)
}

// linkOpener opens our agent's tunnels: CONNECT streams on its link.
type linkOpener struct{ link *h2link.Conn }

func (o linkOpener) roundTrip(req *http.Request) (*http.Response, error) {
	return o.link.RoundTrip(req)
}

func (o linkOpener) takesNew() bool { return o.link.CanTakeNewRequest() }

func (o linkOpener) shutdown(ctx context.Context) {
	if err := o.link.Shutdown(ctx); err != nil {
		o.link.Close()
	}
}

func (o linkOpener) close() { o.link.Close() }

func (o linkOpener) probe(since time.Time, wait time.Duration) { o.link.Probe(since, wait) }

// ourLink is our agent's link, for what only our agents speak beside
// tunnels (the control stream, a tunnel's pause request); nil for an
// upstream agent.
func (a *agentConn) ourLink() *h2link.Conn {
	if o, ok := a.opener.(linkOpener); ok {
		return o.link
	}
	return nil
}

// claimedAttr names the agent in a log line: its ID, and the ID it asked
// for when that is another.
func (a *agentConn) claimedAttr() []any {
	if a.claimedID == "" {
		return []any{"agent", a.id}
	}
	return []any{"agent", a.id, "claimed_id", a.claimedID}
}

// shutdown ends the control stream, then the opener's shutdown.
func (a *agentConn) shutdown(ctx context.Context) {
	a.stopControl()
	a.opener.shutdown(ctx)
}

// usable reports whether a takes a new tunnel now. It takes no lock for
// our agents, so a dial may ask it of many agents.
func (a *agentConn) usable(maxStreams int64) bool {
	return a.tunnels.Load() < maxStreams && !a.doubted.Load() && a.opener.takesNew()
}

// registry holds the connected agents and the index a dial chooses from:
// every agent, those with default-route, and by host, address, CIDR and
// node. Choosing visits only the agents a strategy names, starting at a
// rotating cursor and stopping at the first live usable one, so a dial
// costs the same whatever the number of agents while most can take a
// tunnel. Waiters for any agent block on changed, which is closed and
// replaced whenever an agent joins, or by wake; waiters for one agent ID
// (a resume) block on its channel in arrivals, closed when that agent
// joins, or by wake, so that a fleet logging in after a restart wakes
// each resume once, not once per agent. Every method that reads agents is
// here. Its lock comes after Server.mu and before an agent's link
// (tunnel/doc.go, "Locks").
type registry struct {
	mu       sync.RWMutex
	agents   map[string]*agentConn    // guarded by mu
	idx      agentIndex               // guarded by mu: the agents in agents, indexed
	changed  chan struct{}            // guarded by mu
	arrivals map[string]chan struct{} // guarded by mu: by agent ID, while someone waits for it
	perCred  map[string]int           // guarded by mu: agents in agents by credKey
	next     atomic.Uint64            // rotation among equal agents
}

func newRegistry() *registry {
	return &registry{agents: make(map[string]*agentConn), idx: newAgentIndex(), changed: make(chan struct{}), arrivals: make(map[string]chan struct{}), perCred: make(map[string]int)}
}

// credKey is what MaxAgentsPerCredential counts by: a credential from one
// address (a fleet may share one certificate; each node's agent connects
// from its own address).
func credKey(p Principal, remote string) string { return p.Credential + "@" + hostOf(remote) }

// credRoom reports whether one more agent with key may register under max
// (0: no bound); a login that replaces the connection of its ID with the
// same key takes no more room.
func (r *registry) credRoom(key, id string, max int) (open int, ok bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.credRoomLocked(key, id, max)
}

// credRoomLocked is credRoom; the caller holds r.mu.
func (r *registry) credRoomLocked(key, id string, max int) (open int, ok bool) {
	if max <= 0 {
		return 0, true
	}
	open = r.perCred[key]
	if old := r.agents[id]; old != nil && old.credKey == key {
		open--
	}
	return open, open < max
}

// addLocked registers a, returning the connection it replaces (same
// agent ID), if any; the caller holds r.mu.
func (r *registry) addLocked(a *agentConn) (replaced *agentConn) {
	replaced = r.agents[a.id]
	if replaced != nil {
		r.idx.remove(replaced)
		r.uncountLocked(replaced)
	}
	r.agents[a.id] = a
	r.perCred[a.credKey]++
	r.idx.add(a)
	close(r.changed)
	r.changed = make(chan struct{})
	if ch := r.arrivals[a.id]; ch != nil {
		close(ch)
		delete(r.arrivals, a.id)
	}
	return replaced
}

// wake makes every waiter look again (the server began shutting down).
func (r *registry) wake() {
	r.mu.Lock()
	defer r.mu.Unlock()
	close(r.changed)
	r.changed = make(chan struct{})
	for id, ch := range r.arrivals {
		close(ch)
		delete(r.arrivals, id)
	}
}

// arrival returns the agent with id when it is connected and can take
// back a paused tunnel (not one restarting in place, and not the
// connection not); otherwise a channel closed when an agent with id
// joins, or by wake.
func (r *registry) arrival(id string, not *agentConn) (*agentConn, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if a := r.agents[id]; a != nil && a.canPause && !a.restarting.Load() && a != not {
		return a, nil
	}
	ch := r.arrivals[id]
	if ch == nil {
		ch = make(chan struct{})
		r.arrivals[id] = ch
	}
	return nil, ch
}

func (r *registry) remove(a *agentConn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.agents[a.id] == a {
		delete(r.agents, a.id)
		r.idx.remove(a)
		r.uncountLocked(a)
	}
}

// uncountLocked takes a out of perCred. The caller holds r.mu.
func (r *registry) uncountLocked(a *agentConn) {
	if r.perCred[a.credKey]--; r.perCred[a.credKey] <= 0 {
		delete(r.perCred, a.credKey)
	}
}

func (r *registry) snapshot() []*agentConn {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]*agentConn, 0, len(r.agents))
	for _, a := range r.agents {
		out = append(out, a)
	}
	return out
}

// byID returns the connected agent with id that can take back the
// tunnels a previous image held for it, or nil.
func (r *registry) byID(id string) *agentConn {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if a := r.agents[id]; a != nil && a.canPause && !a.restarting.Load() {
		return a
	}
	return nil
}

func (r *registry) len() int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return len(r.agents)
}

func (r *registry) waitChan() <-chan struct{} {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.changed
}

// dest is a dial's destination as the strategies see it: its host, and the
// node the apiserver says owns it ("" when none does or the node strategy
// is off; mapLoaded false when the server has not read the apiserver's
// view yet). The node is looked up before the registry's lock is taken.
type dest struct {
	host, node string
	mapLoaded  bool
}

// pick chooses an agent for a dial to d, or nil, and says which strategy
// found it. Within a strategy, an exact destHost match beats a CIDR one,
// agents that are not draining beat draining ones, and the choice rotates
// so dials spread across agents.
func (r *registry) pick(d dest, strategies []Strategy, maxStreams int64, exclude map[*agentConn]bool) (*agentConn, Strategy) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	c := chooser{maxStreams: maxStreams, exclude: exclude, turn: r.next.Add(1)}
	for _, st := range strategies {
		var a *agentConn
		switch st {
		case StrategyDefault:
			a = c.choose(r.idx.all.list)
		case StrategyDefaultRoute:
			a = c.choose(r.idx.defaultRoute.list)
		case StrategyNode:
			if d.node != "" {
				a = c.choose(r.idx.nodes[d.node])
			}
		case StrategyDestHost:
			a = r.idx.chooseHost(&c, d.host)
		}
		if a != nil {
			return a, st
		}
	}
	return nil, ""
}

func hostOf(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return host
}

// connectedWithOther reports whether id is connected with a credential other
// than cred.
func (r *registry) connectedWithOther(id, cred string) bool {
	r.mu.RLock()
	defer r.mu.RUnlock()
	old := r.agents[id]
	return old != nil && old.principal.Credential != cred
}

// claim registers a like add, unless its ID was taken meanwhile by a
// connection with another credential (errIDTaken) or its credential holds
// maxPerCred connections from its address already (errCredBound): the
// bound is checked and taken in one step, so logins that passed the early
// check together (credRoom) cannot add up to more.
func (r *registry) claim(a *agentConn, maxPerCred int) (replaced *agentConn, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if old := r.agents[a.id]; old != nil && old.principal.Credential != a.principal.Credential {
		return nil, errIDTaken
	}
	if _, ok := r.credRoomLocked(a.credKey, a.id, maxPerCred); !ok {
		return nil, errCredBound
	}
	return r.addLocked(a), nil
}

// countFor counts agents a dial could use under one strategy.
func (r *registry) countFor(st Strategy, maxStreams int64) int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	n := 0
	for _, a := range r.agents {
		if !a.usable(maxStreams) {
			continue
		}
		switch st {
		case StrategyDefault:
			n++
		case StrategyDefaultRoute:
			if a.ids.DefaultRoute {
				n++
			}
		case StrategyDestHost:
			if len(a.ids.Hosts)+len(a.ids.Addrs)+len(a.ids.CIDRs) > 0 {
				n++
			}
		case StrategyNode:
			if a.node != "" {
				n++
			}
		}
	}
	return n
}
