package server

// The format that crosses execve: what a restart hands the next image with
// each socket, as JSON (docs/restart.md). The envelope that carries it
// (the list of descriptors and entries, the memory file named in the
// environment) is internal/daemon's (handover.go there); an agent's kept
// destination is the agent package's KeptDest; a frozen HTTP/2 connection
// is h2link.Frozen.

import (
	"net"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// resumeWait bounds how long the next image waits for a paused tunnel's
// agent to log in again when the tunnel does not say how long its resume
// can succeed (PausedTunnel.Until: one from an image that did not write
// it); less than the agent's wire.ResumeWindow.
const resumeWait = 20 * time.Second

// PausedTunnel is a frontend tunnel paused for the next image of this
// process: the client's socket and what resuming it needs.
// All but Socket travels to the next image as JSON.
//
// An Unasked one is an HTTP CONNECT connection whose client had not asked
// for a dial yet (its head was not complete): it has no agent, no
// destination and no token, only the bytes read so far (Head), and the
// next image serves it as a new connection.
type PausedTunnel struct {
	Socket  net.Conn    `json:"-"`                 // the client's socket, the front door's own: no second descriptor (docs/restart.md)
	Addr    string      `json:"addr"`              // the destination, as the client asked for it
	Agent   string      `json:"agent"`             // the agent holding the destination connection
	Token   string      `json:"token"`             // the resume token the agent holds it under
	GRPC    *PausedGRPC `json:"grpc,omitempty"`    // set for a gRPC front door call
	Unasked bool        `json:"unasked,omitempty"` // a connection whose client asked for nothing yet
	Head    []byte      `json:"head,omitempty"`    // Unasked: the bytes read from it so far
	// Quiet is how long the tunnel had been quiet (quiet.go) when it was
	// paused, so that a drain of the next image finds an idle keep-alive
	// connection idle; 0: the last bytes came from the client.
	Quiet time.Duration `json:"quiet,omitempty"`
	// Until is how long a resume can succeed, which the next image waits
	// for the agent: the agent keeps the destination for wire.ResumeWindow
	// from the pause, and its credential must still be trusted (a token's
	// expiry; docs/security.md). Zero: resumeWait.
	Until time.Time `json:"until,omitzero"`
}

// resumeUntil is PausedTunnel.Until of a tunnel through a paused now.
func resumeUntil(a *agentConn) time.Time {
	until := time.Now().Add(wire.ResumeWindow)
	if a.cred != nil {
		a.cred.mu.Lock()
		if exp := a.cred.expires; !exp.IsZero() && exp.Before(until) {
			until = exp
		}
		a.cred.mu.Unlock()
	}
	return until
}

// waitFor is how long the next image waits for p's agent.
func (p *PausedTunnel) waitFor() time.Duration {
	if p.Until.IsZero() {
		return resumeWait
	}
	return max(0, time.Until(p.Until))
}

// PausedGRPC is what resuming a gRPC front door call needs besides the
// tunnel: the call's connect ID, the part of a client message read before
// the pause, and the frozen HTTP/2 connection.
type PausedGRPC struct {
	ConnectID int64          `json:"connect_id"`
	Partial   []byte         `json:"partial,omitempty"`
	Link      *h2link.Frozen `json:"link"`
}
