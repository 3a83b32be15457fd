package server

import (
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"
)

// TestResumeWaitsWhileResumeCanSucceed: the next image waits for a paused
// tunnel's agent as long as the agent keeps the destination (wire.ResumeWindow
// from the pause) and the agent's credential is trusted, whichever ends
// first; resumeWait for a tunnel from an image that did not say.
func TestResumeWaitsWhileResumeCanSucceed(t *testing.T) {
	cert := &agentConn{}
	soon := &agentConn{cred: &connCredential{expires: time.Now().Add(5 * time.Second)}}
	late := &agentConn{cred: &connCredential{expires: time.Now().Add(time.Hour)}}
	for _, c := range []struct {
		name     string
		a        *agentConn
		min, max time.Duration
	}{
		{"certificate", cert, wire.ResumeWindow - time.Second, wire.ResumeWindow},
		{"token expiring in 5s", soon, 4 * time.Second, 5 * time.Second},
		{"token expiring in 1h", late, wire.ResumeWindow - time.Second, wire.ResumeWindow},
	} {
		p := &PausedTunnel{Until: resumeUntil(c.a)}
		if w := p.waitFor(); w < c.min || w > c.max {
			t.Errorf("%s: waits %v, want %v to %v", c.name, w, c.min, c.max)
		}
	}
	if w := (&PausedTunnel{}).waitFor(); w != resumeWait {
		t.Errorf("no Until: waits %v, want resumeWait %v", w, resumeWait)
	}
	if w := (&PausedTunnel{Until: time.Now().Add(-time.Second)}).waitFor(); w != 0 {
		t.Errorf("Until passed: waits %v, want 0", w)
	}
}
