package e2e

import (
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestOneTimeWarningsOncePerProcess: a warning the server and the agent
// give once (here: an upstream flag accepted but not honoured) appears
// once in the process's log, not again after every SIGHUP re-executes it.
func TestOneTimeWarningsOncePerProcess(t *testing.T) {
	const warning = "flag accepted for compatibility but not honoured"
	bin := copyExecutable(t, t.TempDir())
	s := startServerBin(t, bin, frontendUDS, "--xfr-channel-size=10", "--agent-wait=10s")
	a := s.launchAgentFrom(t, bin, nil, s.pki, "a1", "", "--xfr-channel-size=10", "--sync-interval=100ms", "--sync-interval-cap=500ms")
	waitHTTP(t, a.proc, a.healthURL("/readyz"), 200)
	for _, p := range []struct {
		name string
		proc *proc
		url  string
	}{{"server", s.proc, s.healthURL("/metrics")}, {"agent", a.proc, a.healthURL("/metrics")}} {
		for i := range 2 {
			before := startTime(p.url)
			p.proc.signal(t, syscall.SIGHUP)
			waitNewImage(t, p.proc, p.url, before, 20*time.Second)
			if n := strings.Count(p.proc.out.String(), "re-executing in place"); n != i+1 {
				t.Fatalf("%s: %d re-executions logged, want %d", p.name, n, i+1)
			}
		}
		if n := strings.Count(p.proc.out.String(), warning); n != 1 {
			t.Errorf("%s: %q logged %d times across two SIGHUPs, want once:\n%s", p.name, warning, n, grepLines(p.proc.out.String(), warning))
		}
	}
}
