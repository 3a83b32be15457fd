package server

import (
	"errors"

	"github.com/spinifex/konnectivity/tunnel/wire"
)

// An agent's restart in place (SIGHUP) hands its tunnels to its next image
// with the handover's protocol (docs/restart.md), the roles of who restarts
// swapped:
//
//  1. The agent tells each server that named featureAgentRestart that it
//     restarts (wire.ControlRestartIn), then that it drains.
//  2. The server pauses every tunnel on that agent's link that can move
//     without loss, exactly as for its own restart (wire.PausePath, byte-exact
//     in both directions), but keeps the client's side here: the paused
//     tunnel waits for the agent's next image as a tunnel a previous image
//     of the server handed over waits for its agent (held in
//     Server.tunnels), so a server restart meanwhile passes it on as it
//     is. The rest drain.
//  3. The agent waits, within its drain timeout, until no tunnel is open,
//     then passes each destination it holds to its next image
//     (Agent.KeptForNextImage): the socket as an inherited descriptor,
//     the token and the time left of its hold as JSON.
//  4. The next image adopts them (Agent.AdoptKept) and logs in with the
//     same ID; the server, seeing an agent with that ID that is not the
//     restarting link, opens the CONNECT stream naming the token, and the
//     tunnel goes on: same client connection, same destination connection.
//
// A server that did not name featureAgentRestart (an older one, or
// upstream's) gets the drain alone. A tunnel whose agent is not back
// within resumeWait is closed, as after a server restart, and a token the
// next image does not hold is refused (404) and its tunnel closed. Rapid
// restarts: a tunnel that becomes pausable on an agent after it announced
// its restart is paused too (opened), and a resume that
// meets an agent image on its way out waits for the next one
// (agentLeaving). The agent's half is in agent_restart.go.

// errAgentRestarting is an agent's refusal of a resume while it restarts
// in place (wire.HdrAgentRestarting): the resume waits for the agent's next
// image, at most maxAgentRestarts times in a row.
var errAgentRestarting = errors.New("agent restarting in place")

// maxAgentRestarts bounds the agent images one resume waits for.
const maxAgentRestarts = 5

// agentLeaving reports a resume that met an agent connection on its way
// out, so that the resume waits for the agent's next one: the agent
// restarts in place (errAgentRestarting), or its connection closed before
// it answered (an image that restarted again as it logged in), which
// took nothing from what it holds.
func agentLeaving(err error) bool {
	var se *wire.StatusError
	return err != nil && (errors.Is(err, errAgentRestarting) || !errors.As(err, &se))
}

// agentRestarting is the server's half: a announced a restart in place,
// so every tunnel on its link that can move is paused for its next image
// (steps 2 and 4 above); a's tunnels that cannot move drain with the
// drain that follows. Once.
func (h *handover) agentRestarting(a *agentConn) {
	s := h.s
	if !a.canPause || a.restarting.Swap(true) {
		return
	}
	todo := h.takeMovable(a) // before the drain line is read: a drain takes only open tunnels
	s.log.Info("agent restarting in place: pausing its tunnels for its next image", "agent", a.id, "remote", a.remote, "tunnels", len(todo))
	h.pauseForAgent(todo)
}

// opened pauses t, a tunnel that has just become pausable,
// for its agent's next image when the agent already announced its
// restart: one resumed or opened on it after agentRestarting took the
// tunnels open then, which would otherwise drain. Whichever of the two
// moves t to pausing (under Server.mu) pauses it; agentRestarting sets
// restarting before it looks, and t is pausable before this looks, so
// neither misses it.
func (h *handover) opened(t *tunnel) {
	s := h.s
	if !t.agent.restarting.Load() {
		return
	}
	s.mu.Lock()
	took := t.agent.canPause && t.front.pausable(t) && t.moveLocked(tunnelPausing)
	s.mu.Unlock()
	if took {
		h.pauseForAgent([]*tunnel{t})
	}
}

// pauseForAgent pauses todo, tunnels moved to pausing for their agent's
// restart, on a goroutine, and holds them for the agent's next image
// (waitForAgent). The batch counts in agentPausing until its tunnels are
// held, so a handover that begins meanwhile waits for them and passes
// them on (collectAgentPauses) instead of losing them.
func (h *handover) pauseForAgent(todo []*tunnel) {
	s := h.s
	if len(todo) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return // Close closed their sockets
	}
	h.agentPausing++
	s.goroutine(func() {
		h.waitForAgent(h.pauseAll(s.baseCtx, todo, "tunnels paused for the agent's next image"))
	})
}

// waitForAgent holds tunnels paused here in the table until their agent's
// next image logs in, as Resume holds those a previous image of the server
// paused, and ends their batch's count in agentPausing. While the server
// shuts down they are held only: a handover passes them on
// (collectAgentPauses), Close drops them; once it closed they are closed.
func (h *handover) waitForAgent(paused []*PausedTunnel) {
	s := h.s
	s.mu.Lock()
	h.agentPausing--
	h.moved.Broadcast()
	if s.closed {
		s.mu.Unlock()
		for _, p := range paused {
			p.Socket.Close()
			h.resumeFailed(p, resultFailed, errors.New("server closed while the agent restarted"))
		}
		return
	}
	for _, p := range paused {
		ht := h.holdLocked(p)
		if !s.shutting {
			s.goroutine(func() { h.resumeTunnel(ht) })
		}
	}
	s.mu.Unlock()
}
