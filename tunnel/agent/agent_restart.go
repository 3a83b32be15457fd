package agent

import (
	"net"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"
)

// The agent's half of its own restart in place (handover_agent.go has
// the protocol): the drain that announces it, and its kept destinations
// across the exec.

// Restarting marks the drain that ends Run as a restart in place: call it
// before cancelling Run's context. Servers that can are asked to pause the
// agent's tunnels for the next image, and the destinations kept for them
// stay open for KeptForNextImage.
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

// KeptDest is a destination connection the agent keeps for a paused
// tunnel, as it travels to the agent's next image. All but Socket travel
// as JSON.
type KeptDest struct {
	Socket net.Conn  `json:"-"`     // the destination socket the agent kept
	Token  string    `json:"token"` // the resume token the server will name
	Dest   string    `json:"dest"`  // the destination's address, for logs
	Until  time.Time `json:"until"` // when it stops being kept
}

// KeptForNextImage takes every destination kept for a resume, for the
// next image of the process: call it once Run returned after Restarting.
// Each socket goes on as it is, no second descriptor (docs/restart.md).
func (a *Agent) KeptForNextImage() []*KeptDest {
	a.mu.Lock()
	kept := a.kept.byToken
	a.kept.byToken = nil
	a.kept.count -= len(kept)
	a.mu.Unlock()
	out := make([]*KeptDest, 0, len(kept))
	for token, p := range kept {
		p.timer.Stop()
		out = append(out, &KeptDest{Socket: p.conn, Token: token, Dest: p.conn.RemoteAddr().String(), Until: p.until})
	}
	if len(out) > 0 {
		a.log.Info("destinations of paused tunnels handed to the next image", "kept", len(out))
	}
	return out
}

// AdoptKept keeps the destinations a previous image of the process kept
// (KeptForNextImage) for the rest of their time: call it before Run. One
// whose time is up, or that is not a socket, is closed and logged.
func (a *Agent) AdoptKept(kept []*KeptDest) {
	adopted := 0
	for _, h := range kept {
		c := h.Socket
		left := time.Until(h.Until)
		switch {
		case left <= 0 || !validToken(h.Token) || len(h.Token) > wire.MaxResumeToken:
			abortConn(c)
			a.log.Warn("kept destination from the previous image expired; closed", "dest", h.Dest)
			continue
		}
		a.mu.Lock()
		full := a.kept.count >= maxPaused
		if !full {
			a.kept.count++
		}
		a.mu.Unlock()
		if full {
			abortConn(c)
			a.log.Warn("kept destination from the previous image closed: too many paused tunnels", "dest", h.Dest)
			continue
		}
		a.keepPaused(h.Token, &pausedDest{conn: c}, left)
		adopted++
	}
	if len(kept) > 0 {
		a.log.Info("destinations of paused tunnels adopted from the previous image", "kept", adopted, "lost", len(kept)-adopted)
	}
}
