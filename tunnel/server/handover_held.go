package server

// The held part of the handover: connections a handover takes before
// their client asked for anything, and paused tunnels that wait in the
// table (held) for their agent or for the handover that passes them on.

import (
	"context"
	"errors"
	"net"
)

// takeUnaskedLocked moves every front-door connection still reading its
// client's head to passing: its goroutine, woken by leaving
// (interruptUnasked), passes it on as it is (passUnasked). Called in the
// same critical section that sets shutting, so each connection either
// asked before (pending, waited for) or is taken here. The caller holds Server.mu.
func (h *handover) takeUnaskedLocked() {
	s := h.s
	for t := range s.tunnels {
		if t.state == tunnelReading {
			t.moveLocked(tunnelPassing)
		}
	}
}

// collectAgentPauses waits until no batch of pauses for an agent's
// restart is running (each tunnel's pause is bounded by pauseTimeout),
// and returns the tunnels they held while the server was shutting down,
// taken off the table: a tunnel paused for its agent's next image goes on
// to the server's next image, whichever restart came first.
func (h *handover) collectAgentPauses() []*PausedTunnel {
	s := h.s
	s.mu.Lock()
	for h.agentPausing > 0 {
		h.moved.Wait()
	}
	out := h.takeHeldLocked(false)
	s.mu.Unlock()
	h.metrics.paused[resultOK].Add(uint64(len(out)))
	return out
}

// collectUnasked waits until no tunnel is passing (each taken connection
// is held, or closed), and returns the held unasked ones, taken off the
// table.
func (h *handover) collectUnasked() []*PausedTunnel {
	s := h.s
	s.mu.Lock()
	h.collected = true
	for s.inState[tunnelPassing] > 0 {
		h.moved.Wait()
	}
	out := h.takeHeldLocked(true)
	s.mu.Unlock()
	if len(out) > 0 {
		s.log.Info("front-door connections that asked for nothing yet handed to the next image", "connections", len(out))
	}
	return out
}

// takeHeld takes the held tunnels off the table for a handover to pass
// on as they are: the unasked connections (unasked) or the paused tunnels
// waiting for their agent.
func (h *handover) takeHeld(unasked bool) []*PausedTunnel {
	s := h.s
	s.mu.Lock()
	defer s.mu.Unlock()
	return h.takeHeldLocked(unasked)
}

// takeHeldLocked is takeHeld. The caller holds Server.mu.
func (h *handover) takeHeldLocked(unasked bool) []*PausedTunnel {
	s := h.s
	var out []*PausedTunnel
	for t := range s.tunnels {
		if t.state == tunnelHeld && t.handed.Unasked == unasked {
			out = append(out, t.handed)
			t.moveLocked(tunnelClosed)
		}
	}
	return out
}

// holdLocked puts p, a paused tunnel that waits for its agent to log in
// again, in the table held, and returns its entry, which no goroutine
// serves. The caller holds Server.mu.
func (h *handover) holdLocked(p *PausedTunnel) *tunnel {
	s := h.s
	t := &tunnel{front: heldFront{}, handed: p, state: tunnelHeld}
	s.enterLocked(t)
	return t
}

// dropHeldLocked closes a held tunnel's socket and takes it off the
// table: the server closes without a next image. The caller holds Server.mu.
func (h *handover) dropHeldLocked(t *tunnel) {
	p := t.handed
	p.Socket.Close()
	t.moveLocked(tunnelClosed)
	if !p.Unasked {
		h.resumeFailed(p, resultFailed, errors.New("server closed before the agent was back"))
	}
}

// heldFront is the front of a held tunnel's entry that holdLocked made:
// its socket is the PausedTunnel's Socket, which only dropHeldLocked and the
// resume close, and nothing else reaches it, as a held tunnel is neither
// open nor served.
type heldFront struct{}

func (heldFront) closeQuiet(*tunnel)    {}
func (heldFront) unread() bool          { return false }
func (heldFront) hangup() net.Conn      { return nil }
func (heldFront) closeSocket()          {}
func (heldFront) pausable(*tunnel) bool { return false }
func (heldFront) pause(context.Context, *tunnel) (*PausedTunnel, error) {
	return nil, errNotPausable
}
