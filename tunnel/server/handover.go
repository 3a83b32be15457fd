package server

import (
	"context"
	"sync"

	"github.com/spinifex/konnectivity/internal/promtext"
)

// A handover moves open frontend tunnels from this server to the next
// image of its process (a self-restart), so that kube-apiserver's
// keep-alive connections to webhooks and kubelets live through it. The
// protocol, its bounds and what is not handed over are described once,
// in docs/restart.md ("The handover"); the code is the handover type
// below and its parts:
//
//   - handover_hooks.go: the hooks the front doors call, and nothing else;
//   - handover_pause.go: steps 1 to 4, a tunnel paused byte-exact in both
//     directions with its agent (the pause path), each on its own;
//   - handover_held.go: connections taken before they asked for anything,
//     and paused tunnels held in the table until their agent is back or
//     the next handover passes them on;
//   - handover_resume.go: step 5, a paused tunnel going on once its agent
//     is back;
//   - handover_agent.go: the same protocol for an agent's restart;
//   - handed.go: what crosses execve with each socket.
//
// Only an open tunnel moves to pausing (tunnel.go), so a drain never
// closes a tunnel being paused; the wire words (the pause path and its
// headers) are in the wire package, with the rest of what both sides
// speak.

// HandOver is Shutdown for a self-restart: before the drain it pauses
// every tunnel that can move to the next image without loss and returns
// them; the caller passes their sockets on, and the next image calls
// Resume. Tunnels that cannot move drain as with Shutdown.
func (s *Server) HandOver(ctx context.Context) ([]*PausedTunnel, error) {
	err := s.shutdown(ctx, true)
	return s.hand.out, err
}

// A handover's steps, in the order shutdown runs them on its goroutine:
//
//   - beginLocked, in the critical section that sets shutting: the
//     connections that asked for nothing yet are taken (each asked
//     before, and is waited for as pending, or is taken here);
//   - take, once the dials asked for are answered and before the drain
//     closes any tunnel: the open tunnels that can move go to pausing,
//     the held ones are taken as they are, the taken connections are
//     collected;
//   - pause, while the drain closes the rest: what take took is paused,
//     each tunnel on its own, and the pauses of an agent's restart are
//     collected. HandOver returns what the steps gathered (out).

// beginLocked is the first step. The caller holds Server.mu.
func (h *handover) beginLocked() {
	h.active = true
	h.takeUnaskedLocked()
}

// take is the second step.
func (h *handover) take() {
	h.todo = h.takeMovable(nil)
	h.out = h.takeHeld(false) // still paused: passed on as they are
	h.metrics.paused[resultOK].Add(uint64(len(h.out)))
	h.out = append(h.out, h.collectUnasked()...)
}

// pause is the last step.
func (h *handover) pause(ctx context.Context) {
	h.out = append(h.out, h.pauseAll(ctx, h.todo, "tunnels paused for the next image")...)
	h.out = append(h.out, h.collectAgentPauses()...)
	h.todo = nil
}

// restartMetrics count what a restart moved: tunnels paused here for the
// next image, and tunnels the next image resumed, by result.
type restartMetrics struct {
	paused, resumed map[string]*promtext.Counter // immutable maps of the results
}

func newRestartMetrics(m *promtext.Registry) restartMetrics {
	h := restartMetrics{paused: map[string]*promtext.Counter{}, resumed: map[string]*promtext.Counter{}}
	for _, r := range []string{resultOK, resultFailed, resultTimeout, resultNotPausable} {
		h.paused[r] = m.Counter(serverPrefix+"tunnels_paused_total", "Tunnels a restart paused to hand to the next image, by result (not_pausable: drained instead).", []string{"result"}, r)
	}
	for _, r := range []string{resultOK, resultFailed, resultTimeout} {
		h.resumed[r] = m.Counter(serverPrefix+"tunnels_resumed_total", "Tunnels a previous image paused and this one resumed, by result (timeout: the agent did not come back).", []string{"result"}, r)
	}
	return h
}

// RestartStatus counts the tunnels a restart paused here for the next
// image, and those this image resumed, by result (ok, failed, timeout,
// not_pausable); the same counts as the tunnels_paused_total and
// tunnels_resumed_total metrics.
type RestartStatus struct {
	Paused  map[string]uint64 `json:"paused"`
	Resumed map[string]uint64 `json:"resumed"`
}

// restartStatus is RestartStatus now.
func (h *handover) restartStatus() *RestartStatus {
	return &RestartStatus{Paused: counts(h.metrics.paused), Resumed: counts(h.metrics.resumed)}
}

// counts returns the counters by result, for status.
func counts(cs map[string]*promtext.Counter) map[string]uint64 {
	out := make(map[string]uint64, len(cs))
	for r, c := range cs {
		out[r] = c.Value()
	}
	return out
}

// handover is the server's part of a restart in place (docs/restart.md):
// it pauses the open tunnels that can move to the next image, passes on
// the connections that asked for nothing yet and the dials no agent took,
// holds the paused tunnels that wait for their agent (the server's own
// next image, or its agent's), and resumes what a previous image handed
// over. One per Server; the front doors reach it only through its hooks
// (handover_hooks.go), the shutdown through its steps (HandOver).
//
// Its fields are guarded by Server.mu: they change in the critical
// sections that move tunnels in the table.
type handover struct {
	s       *Server        // immutable
	metrics restartMetrics // immutable: what restarts moved, by result
	// moved is signalled, its L being &Server.mu, when what a handover
	// waits for moves on: a passing tunnel (passUnasked, for
	// collectUnasked), a batch of pauses for an agent's restart
	// (waitForAgent, for collectAgentPauses).
	moved sync.Cond
	// agentPausing counts batches of tunnels being paused for an agent's
	// restart in place whose paused tunnels are not held yet
	// (pauseForAgent).
	agentPausing int
	active       bool // the shutdown under way is a handover: a dial no agent took yet moves too (dialWaiting)
	collected    bool // the handover collected the held unasked tunnels: no dial moves to passing any more (collectUnasked)

	// Owned by the goroutine that runs the shutdown (its steps).
	todo []*tunnel       // the tunnels take moved to pausing
	out  []*PausedTunnel // what goes to the next image
}

func newHandover(s *Server) *handover {
	h := &handover{s: s, metrics: newRestartMetrics(s.cfg.Metrics)}
	h.moved.L = &s.mu
	return h
}
