package server

import (
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// tunnel is one dial on the server, from the client's side of a front door
// to the agent's stream: everything the server knows of it is here, and
// every per-tunnel task (the quiet drain, the hang-up sweep, a handover,
// status and metrics) finds it in one table, Server.tunnels. The two front
// doors differ only in front.
type tunnel struct {
	// Immutable once the tunnel is in Server.tunnels.
	s     *Server
	front front // the client's side: an HTTP CONNECT socket or a gRPC call

	// Owned by the goroutine that serves the tunnel until it moves to
	// open; read-only from then on (the move is made under Server.mu).
	addr   string             // the destination, as the client asked for it
	agent  *agentConn         // the agent the stream runs through
	body   io.ReadCloser      // the stream's answer: the agent's bytes
	cancel context.CancelFunc // ends the stream (RST_STREAM while it is open)
	since  time.Time          // when the agent answered
	// handed is the paused tunnel this one resumes (a previous image
	// paused it) or, held, the one it waits to resume or pass on: set
	// before the tunnel enters the table, or with its move to held under
	// Server.mu; read-only while it is held.
	handed *PausedTunnel

	up   upload                          // the client's bytes toward the agent
	down atomic.Pointer[h2link.Delivery] // the agent's bytes toward the client, once they flow
	act  wire.Activity                   // the tunnel's traffic, for the quiet drain (quiet.go)

	state    tunnelState // guarded by Server.mu; changed only by moveLocked
	hungSeen bool        // owned by the hang-up sweep (hangup.go)
	endOnce  sync.Once   // endStream
}

// front is the client's side of a tunnel: what differs between the HTTP
// CONNECT front door (frontend.go) and the gRPC one (grpc_frontend.go).
type front interface {
	// closeQuiet ends the tunnel the way a client sees a server close an
	// idle connection. Called once, outside every lock.
	closeQuiet(t *tunnel)
	// unread reports bytes the client sent that were not read yet.
	unread() bool
	// hangup is the client's Unix socket, swept for a client that left
	// (hangup.go); nil when it cannot be told this way.
	hangup() net.Conn
	// closeSocket closes the client's socket: the server is closing.
	closeSocket()
	// pausable and pause are the front door's half of a handover
	// (handover.go).
	pausable(t *tunnel) bool
	pause(ctx context.Context, t *tunnel) (*PausedTunnel, error)
}

// tunnelState is where a tunnel is in its life. Every change goes through
// moveLocked and the table tunnelMoves.
type tunnelState uint8

const (
	tunnelDialing  tunnelState = iota // in the table, the agent has not answered: only Close ends it
	tunnelOpen                        // carrying bytes both ways
	tunnelDraining                    // a drain is closing it at a quiet moment
	tunnelPausing                     // a handover is stopping it
	tunnelPaused                      // handed to the next image; its stream here ends
	tunnelClosed                      // out of the table
	tunnelReading                     // an HTTP CONNECT connection whose client has not asked for a dial yet: its head is being read
	tunnelPassing                     // taken by a handover before any agent was asked: its goroutine is passing its socket on
	tunnelHeld                        // paused, handed ready, and served by no goroutine: waiting for its agent, or for the handover that took it
	numTunnelStates
)

var tunnelStateNames = [numTunnelStates]string{"dialing", "open", "draining", "pausing", "paused", "closed", "reading", "passing", "held"}

func (st tunnelState) String() string { return tunnelStateNames[st] }

// tunnelMoves is the one table of a tunnel's states: the states each may
// move to. Closed is where every tunnel ends, when the goroutine serving it
// returns (Server.leave), or, held, when it is resumed, passed on or
// dropped; a drain and a handover take only open tunnels, so the two never
// meet on one.
//
// A handover also passes on, as they are, connections still reading their
// head (reading to passing): nothing was asked for, so there is nothing to
// stop; and dials still waiting for an agent (dialing to passing): no agent
// was asked. Their goroutine duplicates the socket and moves the tunnel
// to held (passing to held, handed Unasked) for the handover to collect
// (collectUnasked).
//
// A held tunnel is a paused one no goroutine serves: besides those, a
// tunnel a previous image handed over (Resume) or that its agent's restart
// in place paused here (waitForAgent) enters the table held until its
// agent logs in again; the tunnel that resumes it then enters as a new
// one, and a handover meanwhile passes it on as it is.
var tunnelMoves = [numTunnelStates][]tunnelState{
	tunnelDialing:  {tunnelOpen, tunnelPassing, tunnelClosed},
	tunnelOpen:     {tunnelDraining, tunnelPausing, tunnelClosed},
	tunnelDraining: {tunnelClosed},
	tunnelPausing:  {tunnelPaused, tunnelClosed},
	tunnelPaused:   {tunnelClosed},
	tunnelClosed:   nil,
	tunnelReading:  {tunnelDialing, tunnelPassing, tunnelClosed},
	tunnelPassing:  {tunnelHeld, tunnelClosed},
	tunnelHeld:     {tunnelClosed},
}

// shownStates are the states status and metrics count tunnels in: a
// connection reading its head or dialing is not a tunnel to an operator
// yet (pending_backend_dials counts the dials).
var shownStates = []tunnelState{tunnelOpen, tunnelDraining, tunnelPausing, tunnelPaused, tunnelPassing, tunnelHeld}

// moveLocked moves t to next if tunnelMoves allows it, and reports whether
// it did; a tunnel that closes leaves the table. The caller holds Server.mu.
func (t *tunnel) moveLocked(next tunnelState) bool {
	for _, ok := range tunnelMoves[t.state] {
		if ok == next {
			t.s.inState[t.state]--
			t.state = next
			if next == tunnelClosed {
				t.s.leftLocked(t)
			} else {
				t.s.inState[next]++
			}
			return true
		}
	}
	return false
}

// move is moveLocked under Server.mu.
func (t *tunnel) move(next tunnelState) bool {
	t.s.mu.Lock()
	defer t.s.mu.Unlock()
	return t.moveLocked(next)
}

// enter puts a new tunnel in the table, dialing (or reading, when the
// caller set that state first); false once the server closed.
func (s *Server) enter(t *tunnel) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.enterLocked(t)
	return true
}

// enterLocked puts t in the table in the state it has. The caller holds Server.mu.
func (s *Server) enterLocked(t *tunnel) {
	t.s = s
	s.tunnels[t] = struct{}{}
	s.inState[t.state]++
}

// leave ends t's time in the table: the goroutine serving it returns. A
// held tunnel stays, served by none, until it is passed on or dropped.
// handedOn reports a tunnel paused or held: its socket went to a
// handover, and its goroutine does not close it.
func (s *Server) leave(t *tunnel) (handedOn bool) {
	s.mu.Lock()
	handedOn = t.state == tunnelPaused || t.state == tunnelHeld
	if t.state != tunnelHeld {
		t.moveLocked(tunnelClosed)
	}
	s.mu.Unlock()
	return handedOn
}

// leftLocked takes a closed tunnel off the table. The caller holds Server.mu.
func (s *Server) leftLocked(t *tunnel) {
	delete(s.tunnels, t)
	s.emptiedLocked()
}

// enterGRPCConn and leaveGRPCConn count a gRPC front door connection, which
// a drain waits for as for a tunnel: its last call's status goes out after
// the call's tunnel left the table. enterGRPCConn is false once the server
// closed.
func (s *Server) enterGRPCConn() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.grpcConns++
	return true
}

func (s *Server) leaveGRPCConn() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.grpcConns--
	s.emptiedLocked()
}

// emptyLocked reports whether no tunnel but held ones and no gRPC
// connection is left: a drain does not wait for a held tunnel, which no
// goroutine serves (a handover passes it on first, Close drops it).
// The caller holds Server.mu.
func (s *Server) emptyLocked() bool {
	return len(s.tunnels) == s.inState[tunnelHeld] && s.grpcConns == 0
}

// emptiedLocked wakes waitTunnels once emptyLocked. The caller holds Server.mu.
func (s *Server) emptiedLocked() {
	if s.emptyLocked() && s.emptied != nil {
		close(s.emptied)
		s.emptied = nil
	}
}

// waitTunnels waits until no tunnel but held ones and no gRPC connection
// is left, or ctx ends.
func (s *Server) waitTunnels(ctx context.Context) error {
	s.mu.Lock()
	if s.emptyLocked() {
		s.mu.Unlock()
		return nil
	}
	if s.emptied == nil {
		s.emptied = make(chan struct{})
	}
	emptied := s.emptied
	s.mu.Unlock()
	select {
	case <-emptied:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// tunnelsIn returns the tunnels in state st.
func (s *Server) tunnelsIn(st tunnelState) []*tunnel {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*tunnel
	for t := range s.tunnels {
		if t.state == st {
			out = append(out, t)
		}
	}
	return out
}

// countTunnels counts the tunnels in state st.
func (s *Server) countTunnels(st tunnelState) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inState[st]
}

// established records the agent's answer: t carries bytes from here on.
func (t *tunnel) established(a *agentConn, body io.ReadCloser, cancel context.CancelFunc) {
	t.agent, t.body, t.cancel, t.since = a, body, cancel, time.Now()
	t.up.counters = append(t.up.counters, &a.bytesTo) // read only after start
	t.s.metrics.established.Add(1)
}

// endStream ends the agent's stream (RST_STREAM if it is still open);
// safe to repeat, and to call from any goroutine.
func (t *tunnel) endStream() {
	t.endOnce.Do(func() {
		t.body.Close()
		t.cancel()
		t.agent.tunnels.Add(-1)
		t.s.metrics.established.Add(-1)
		t.s.metrics.connDuration.ObserveDuration(time.Since(t.since))
	})
}

// fromAgent counts n bytes the agent sent and that went to the client.
func (t *tunnel) fromAgent(n int64) {
	t.s.Stats.BytesFromAgent.Add(n)
	t.agent.bytesFrom.Add(n)
}

// carrier carries one direction of a tunnel whose source can say when it
// has bytes (the gRPC front door's call and its agent's stream, both on
// our links) on goroutines that exist only while bytes move: step carries
// until its source is quiet, having asked the source to wake the carrier
// when bytes come (h2link's Notify), or until the direction ends. A quiet
// direction then holds no goroutine, and no buffer.
//
// At most one goroutine runs step at a time: wake starts one only from
// parked, and one woken while it runs steps again before it parks. The
// states and their moves are in carrierMoves.
type carrier struct {
	step  func() (ended bool) // immutable; runs on the carrier's goroutine only
	spawn func(func())        // immutable: starts an owned goroutine

	// mu guards state. A leaf: wake runs outside every other lock (the
	// link's callbacks run outside theirs).
	mu    sync.Mutex
	state carrierState
}

// carrierState is where a carrier is; every change goes through
// carrier.moveLocked and the table carrierMoves.
type carrierState uint8

const (
	carrierParked  carrierState = iota // no goroutine: wake starts one
	carrierRunning                     // a goroutine runs step
	carrierRewoken                     // running, and woken since its step began: it steps again
	carrierEnded                       // the direction ended: wake does nothing
	numCarrierStates
)

// carrierMoves is the one table of a carrier's states.
var carrierMoves = [numCarrierStates][]carrierState{
	carrierParked:  {carrierRunning},
	carrierRunning: {carrierRewoken, carrierParked, carrierEnded},
	carrierRewoken: {carrierRunning, carrierEnded},
	carrierEnded:   nil,
}

func (c *carrier) moveLocked(next carrierState) bool {
	for _, ok := range carrierMoves[c.state] {
		if ok == next {
			c.state = next
			return true
		}
	}
	return false
}

// wake has the direction carried: a goroutine starts if none runs.
func (c *carrier) wake() {
	c.mu.Lock()
	start := false
	switch c.state {
	case carrierParked:
		start = c.moveLocked(carrierRunning)
	case carrierRunning:
		c.moveLocked(carrierRewoken)
	}
	c.mu.Unlock()
	if start {
		c.spawn(c.run)
	}
}

// run is the carrier's goroutine: it steps until the source is quiet with
// no wake pending, or the direction ends.
func (c *carrier) run() {
	for {
		ended := c.step()
		c.mu.Lock()
		switch {
		case ended:
			c.moveLocked(carrierEnded)
		case c.state == carrierRewoken:
			c.moveLocked(carrierRunning)
			c.mu.Unlock()
			continue
		default:
			c.moveLocked(carrierParked)
		}
		c.mu.Unlock()
		return
	}
}
