package tunnel

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// Strategy is one way of choosing an agent for a dial; the server tries its
// strategies in order and uses the first that finds an agent.
type Strategy string

const (
	StrategyDefault      Strategy = "default"      // any agent, spread round-robin
	StrategyDestHost     Strategy = "destHost"     // the agent whose identifiers name the destination host
	StrategyDefaultRoute Strategy = "defaultRoute" // agents that advertised default-route=true
)

// ParseStrategies parses upstream's --proxy-strategies list.
func ParseStrategies(s string) ([]Strategy, error) {
	var out []Strategy
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		switch Strategy(part) {
		case StrategyDefault, StrategyDestHost, StrategyDefaultRoute:
			out = append(out, Strategy(part))
		case "":
		default:
			return nil, fmt.Errorf("unknown proxy strategy %q (want default, destHost or defaultRoute)", part)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no proxy strategy given")
	}
	return out, nil
}

// agentConn is one agent's connection to this server and, for our agents, its link.
type agentConn struct {
	id       string
	ids      Identifiers
	remote   string
	since    time.Time
	link     *h2link.Conn
	conn     *watchedConn
	streams  atomic.Int64
	draining atomic.Bool

	bytesTo, bytesFrom atomic.Int64

	stopControl context.CancelFunc // ends the control stream, which would hold a graceful shutdown open
	principal   Principal          // what the agent's credential proves; fixed at login
	cred        *connCredential    // the credential the connection stands on; set before it is registered
	up          *upstreamAgent     // set for an upstream (gRPC) agent, which has no link
	canPause    bool               // it pauses and resumes tunnels (handover.go); fixed at login
}

// roundTrip opens one tunnel: an HTTP/2 CONNECT stream, or a dial on an
// upstream agent's Packet stream.
func (a *agentConn) roundTrip(req *http.Request) (*http.Response, error) {
	if a.up != nil {
		return a.up.roundTrip(req)
	}
	return a.link.RoundTrip(req)
}

// close ends the agent's connection at once.
func (a *agentConn) close() {
	if a.up != nil {
		a.up.close()
		a.up.stopOnce.Do(func() { close(a.up.stop) })
		return
	}
	a.link.Close()
}

// shutdown sends GOAWAY and waits for the agent's tunnels to end, or for ctx.
func (a *agentConn) shutdown(ctx context.Context) {
	a.stopControl()
	if a.up != nil {
		a.up.shutdown(ctx)
		return
	}
	if err := a.link.Shutdown(ctx); err != nil {
		a.link.Close()
	}
}

func (a *agentConn) usable(maxStreams int64) bool {
	if a.streams.Load() >= maxStreams {
		return false
	}
	if a.up != nil {
		return a.up.usable()
	}
	return a.link.CanTakeNewRequest()
}

// registry holds the connected agents. Waiters block on changed, which is
// closed and replaced whenever an agent joins, or by wake.
type registry struct {
	mu      sync.Mutex
	agents  map[string]*agentConn
	changed chan struct{}
	next    atomic.Uint64
}

func newRegistry() *registry {
	return &registry{agents: make(map[string]*agentConn), changed: make(chan struct{})}
}

// add registers a, returning the connection it replaces (same agent ID), if any.
func (r *registry) add(a *agentConn) (replaced *agentConn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	replaced = r.agents[a.id]
	r.agents[a.id] = a
	close(r.changed)
	r.changed = make(chan struct{})
	return replaced
}

// wake makes every waiter look again (the server began shutting down).
func (r *registry) wake() {
	r.mu.Lock()
	defer r.mu.Unlock()
	close(r.changed)
	r.changed = make(chan struct{})
}

func (r *registry) remove(a *agentConn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.agents[a.id] == a {
		delete(r.agents, a.id)
	}
}

func (r *registry) snapshot() []*agentConn {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*agentConn, 0, len(r.agents))
	for _, a := range r.agents {
		out = append(out, a)
	}
	return out
}

func (r *registry) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.agents)
}

func (r *registry) waitChan() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.changed
}

// pick chooses an agent for a dial to host, or nil. Within a strategy,
// agents that are not draining are preferred, and the choice rotates so
// dials spread across agents.
func (r *registry) pick(host string, strategies []Strategy, maxStreams int64, exclude map[*agentConn]bool) *agentConn {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, st := range strategies {
		var best []*agentConn
		bestRank := 0
		for _, a := range r.agents {
			if exclude[a] || !a.usable(maxStreams) {
				continue
			}
			rank := 0
			switch st {
			case StrategyDefault:
				rank = 1
			case StrategyDefaultRoute:
				if a.ids.DefaultRoute {
					rank = 1
				}
			case StrategyDestHost:
				rank = int(a.ids.matchHost(host))
			}
			if rank == 0 {
				continue
			}
			if !a.draining.Load() {
				rank += 10 // any live agent beats every draining one
			}
			switch {
			case rank > bestRank:
				best, bestRank = append(best[:0], a), rank
			case rank == bestRank:
				best = append(best, a)
			}
		}
		if len(best) > 0 {
			return best[r.next.Add(1)%uint64(len(best))]
		}
	}
	return nil
}

func hostOf(addr string) string {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return host
}

// agentDraining reports whether the named agent told this server it drains.
func (s *Server) agentDraining(id string) bool {
	s.agents.mu.Lock()
	defer s.agents.mu.Unlock()
	a := s.agents.agents[id]
	return a != nil && a.draining.Load()
}
