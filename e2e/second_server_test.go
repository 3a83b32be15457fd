package e2e

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSecondServerLeavesSocket: the same server command run again (by
// hand beside the service, or a second start) must not take the first
// one's frontend socket: the first keeps serving kube-apiserver through
// it. A socket nothing listens on (a server killed with SIGKILL) is taken
// over.
func TestSecondServerLeavesSocket(t *testing.T) {
	s := startServer(t)
	s.startAgent(t, "a1", "")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialer(t)
	checkReachable(t, d, backend, "b1", 1)

	second := func(t *testing.T, args []string) *proc {
		t.Helper()
		p := startProc(t, "second-server", args...)
		select {
		case <-p.done:
		case <-time.After(startTimeout):
			t.Fatalf("the second server is still running after %v; it must refuse to start:\n%s", startTimeout, p.out.String())
		}
		if p.waitErr == nil {
			t.Fatalf("the second server exited 0; want a failure:\n%s", p.out.String())
		}
		if _, err := os.Lstat(s.sock); err != nil {
			t.Fatalf("the first server's socket is gone after the second server ran: %v\nsecond server:\n%s", err, p.out.String())
		}
		checkReachable(t, d, backend, "b1", 2)
		return p
	}

	t.Run("same-command", func(t *testing.T) {
		p := second(t, s.args)
		if out := p.out.String(); !strings.Contains(out, "address already in use") {
			t.Fatalf("the second server's error does not name the port in use:\n%s", out)
		}
	})

	t.Run("other-ports", func(t *testing.T) {
		args := append(append([]string{}, s.args...),
			"--agent-port="+strconv.Itoa(freePort(t)),
			"--health-port="+strconv.Itoa(freePort(t)),
			"--admin-port="+strconv.Itoa(freePort(t)))
		p := second(t, args)
		want := fmt.Sprintf("process %d listens on it", s.proc.cmd.Process.Pid)
		if out := p.out.String(); !strings.Contains(out, want) || !strings.Contains(out, s.sock) {
			t.Fatalf("the second server's error does not say %q about %s:\n%s", want, s.sock, out)
		}
	})

	t.Run("stale-socket-taken-over", func(t *testing.T) {
		s.proc.signal(t, syscall.SIGKILL)
		<-s.proc.done
		if _, err := os.Lstat(s.sock); err != nil {
			t.Fatalf("SIGKILL should leave the socket behind: %v", err)
		}
		s.launch(t)
		s.startAgent(t, "a2", "")
		checkReachable(t, d, backend, "b1", 2)
	})
}
