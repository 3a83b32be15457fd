package tunnel

import (
	"errors"
	"net"
	"os"
	"time"
)

// An agent's restart in place (SIGHUP) hands its tunnels to its next image
// with the handover's protocol (handover.go), the roles of who restarts
// swapped:
//
//  1. The agent tells each server that named featureAgentRestart that it
//     restarts (controlRestartIn), then that it drains.
//  2. The server pauses every tunnel on that agent's link that can move
//     without loss, exactly as for its own restart (pausePath, byte-exact
//     in both directions), but keeps the client's side here: the paused
//     tunnel waits for the agent's next image as a tunnel a previous image
//     of the server handed over waits for its agent (Server.waiting), so a
//     server restart meanwhile passes it on as it is. The rest drain.
//  3. The agent waits, within its drain timeout, until no tunnel is open,
//     then passes each destination it holds to its next image
//     (HeldForNextImage): the socket as an inherited descriptor, the token
//     and the time left of its hold as JSON.
//  4. The next image adopts them (AdoptHeld) and logs in with the same ID;
//     the server, seeing an agent with that ID that is not the restarting
//     link, opens the CONNECT stream naming the token, and the tunnel goes
//     on: same client connection, same destination connection.
//
// A server that did not name featureAgentRestart (an older one, or
// upstream's) gets the drain alone, as before. A tunnel whose agent is not
// back within resumeWait is closed, as after a server restart, and a token
// the next image does not hold is refused (404) and its tunnel closed.

// Restarting marks the drain that ends Run as a restart in place: call it
// before cancelling Run's context. Servers that can are asked to pause the
// agent's tunnels for the next image, and the destinations held for them
// stay open for HeldForNextImage.
func (a *Agent) Restarting() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.restarting = true
}

func (a *Agent) isRestarting() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.restarting
}

// HeldDest is a destination connection the agent holds for a paused
// tunnel, as it travels to the agent's next image. All but File travel as
// JSON.
type HeldDest struct {
	File  *os.File  `json:"-"`     // a duplicate of the destination socket, close-on-exec set
	Token string    `json:"token"` // the resume token the server will name
	Dest  string    `json:"dest"`  // the destination's address, for logs
	Until time.Time `json:"until"` // when the hold ends
}

// HeldForNextImage takes every destination held for a resume, for the
// next image of the process: call it once Run returned after Restarting.
// A destination whose socket cannot be duplicated is closed, with a
// reset, and logged.
func (a *Agent) HeldForNextImage() []*HeldDest {
	a.mu.Lock()
	held := a.held.byToken
	a.held.byToken = nil
	a.held.count -= len(held)
	a.mu.Unlock()
	out := make([]*HeldDest, 0, len(held))
	for token, p := range held {
		p.timer.Stop()
		f, err := dupSocketFile(p.conn)
		dest := p.conn.RemoteAddr().String()
		abortConnIf(p.conn, err != nil)
		if err != nil {
			a.log.Warn("held destination cannot go to the next image; closed", "dest", dest, "err", err)
			continue
		}
		out = append(out, &HeldDest{File: f, Token: token, Dest: dest, Until: p.until})
	}
	if len(out) > 0 {
		a.log.Info("destinations of paused tunnels handed to the next image", "held", len(out))
	}
	return out
}

// abortConnIf closes c, with a reset when abort is set (abortConn); a
// plain close otherwise, which leaves a duplicate of the socket as it is.
func abortConnIf(c net.Conn, abort bool) {
	if abort {
		abortConn(c)
		return
	}
	c.Close()
}

// AdoptHeld holds the destinations a previous image of the process held
// (HeldForNextImage) for the rest of their time: call it before Run. One
// whose time is up, or that is not a socket, is closed and logged.
func (a *Agent) AdoptHeld(held []*HeldDest) {
	adopted := 0
	for _, h := range held {
		c, err := net.FileConn(h.File)
		h.File.Close()
		left := time.Until(h.Until)
		switch {
		case err != nil:
			a.log.Warn("held destination from the previous image unusable; its tunnel is lost", "dest", h.Dest, "err", err)
			continue
		case left <= 0 || !validToken(h.Token) || len(h.Token) > maxResumeToken:
			abortConn(c)
			a.log.Warn("held destination from the previous image expired; closed", "dest", h.Dest)
			continue
		}
		a.mu.Lock()
		full := a.held.count >= maxPaused
		if !full {
			a.held.count++
		}
		a.mu.Unlock()
		if full {
			abortConn(c)
			a.log.Warn("held destination from the previous image closed: too many paused tunnels", "dest", h.Dest)
			continue
		}
		a.holdPaused(h.Token, &pausedDest{conn: c}, left)
		adopted++
	}
	if len(held) > 0 {
		a.log.Info("destinations of paused tunnels adopted from the previous image", "held", adopted, "lost", len(held)-adopted)
	}
}

// agentRestarting is the server's half: a announced a restart in place,
// so every tunnel on its link that can move is paused for its next image
// (steps 2 and 4 above); a's tunnels that cannot move drain with the
// drain that follows. Once.
func (s *Server) agentRestarting(a *agentConn) {
	if !a.canPause || a.restarting.Swap(true) {
		return
	}
	todo := s.takeMovable(a) // before the drain line is read: a drain takes only open tunnels
	s.log.Info("agent restarting in place: pausing its tunnels for its next image", "agent", a.id, "remote", a.remote, "tunnels", len(todo))
	s.goroutineUnlessClosed(func() {
		s.waitForAgent(s.pauseAll(s.baseCtx, todo, "tunnels paused for the agent's next image"))
	})
}

// waitForAgent keeps tunnels paused here waiting for their agent's next
// image, as Resume keeps those a previous image of the server paused. A
// server shutting down meanwhile closes them: its handover has taken the
// waiting ones already.
func (s *Server) waitForAgent(paused []*PausedTunnel) {
	if len(paused) == 0 {
		return
	}
	s.mu.Lock()
	if s.shutting {
		s.mu.Unlock()
		for _, p := range paused {
			p.File.Close()
			s.resumeFailed(p, resultFailed, errors.New("server shutting down while the agent restarted"))
		}
		return
	}
	for _, p := range paused {
		s.waiting[p] = struct{}{}
	}
	for _, p := range paused {
		s.goroutine(func() { s.resumeTunnel(p) })
	}
	s.mu.Unlock()
}
