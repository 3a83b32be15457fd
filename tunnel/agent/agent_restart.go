package agent

import (
	"net"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"
)

// The agent's half of its own restart in place (handover_agent.go has
// the protocol): the drain that announces it, and its held destinations
// across the exec.

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
// tunnel, as it travels to the agent's next image. All but Socket travel
// as JSON.
type HeldDest struct {
	Socket net.Conn  `json:"-"`     // the destination socket the agent held
	Token  string    `json:"token"` // the resume token the server will name
	Dest   string    `json:"dest"`  // the destination's address, for logs
	Until  time.Time `json:"until"` // when the hold ends
}

// HeldForNextImage takes every destination held for a resume, for the
// next image of the process: call it once Run returned after Restarting.
// Each socket goes on as it is, no second descriptor (docs/restart.md).
func (a *Agent) HeldForNextImage() []*HeldDest {
	a.mu.Lock()
	held := a.held.byToken
	a.held.byToken = nil
	a.held.count -= len(held)
	a.mu.Unlock()
	out := make([]*HeldDest, 0, len(held))
	for token, p := range held {
		p.timer.Stop()
		out = append(out, &HeldDest{Socket: p.conn, Token: token, Dest: p.conn.RemoteAddr().String(), Until: p.until})
	}
	if len(out) > 0 {
		a.log.Info("destinations of paused tunnels handed to the next image", "held", len(out))
	}
	return out
}

// AdoptHeld holds the destinations a previous image of the process held
// (HeldForNextImage) for the rest of their time: call it before Run. One
// whose time is up, or that is not a socket, is closed and logged.
func (a *Agent) AdoptHeld(held []*HeldDest) {
	adopted := 0
	for _, h := range held {
		c := h.Socket
		left := time.Until(h.Until)
		switch {
		case left <= 0 || !validToken(h.Token) || len(h.Token) > wire.MaxResumeToken:
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
