package e2e

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestAgentAtHealthPort: an agent pointed at the server's health port (a
// plain-HTTP port) says so, instead of reading the answer as the agent
// port's admission limit.
func TestAgentAtHealthPort(t *testing.T) {
	s := startServer(t)
	a := s.launchAgent(t, s.pki, "a1", "", "--proxy-server-port="+strconv.Itoa(s.healthPort), "--sync-interval=100ms", "--sync-interval-cap=500ms")
	waitFor(t, 20*time.Second, "the agent logs why it cannot connect", func() bool {
		return strings.Contains(a.proc.out.String(), "server connection failed")
	})
	out := a.proc.out.String()
	if !strings.Contains(out, "not a konnectivity agent port?") || strings.Contains(out, "too many connections waiting to be admitted") {
		t.Fatalf("the agent does not name a plain-HTTP port as such:\n%s", grepLines(out, "server connection failed"))
	}
	t.Logf("%s", strings.TrimSpace(grepLines(out, "server connection failed")))
}
