package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestStopDuringRestartDrain: a SIGTERM that arrives while a SIGHUP
// restart is draining stops the process; it must not re-execute into a
// new image that never saw the SIGTERM (supervise-daemon's stop would then
// wait for its KILL). An open tunnel that cannot be handed over (its
// client has half-closed, its destination has not) keeps each drain going.
func TestStopDuringRestartDrain(t *testing.T) {
	s := startServer(t, "--restart-grace=3s")
	a := s.startAgent(t, "a1", "", "--drain-timeout=3s")
	// A destination that reads to the end and then keeps its side open:
	// a tunnel whose client has half-closed cannot be handed to the next
	// image, so it holds the server's drain (and the agent's) open.
	held := make(chan struct{})
	backend := startTCPBackend(t, "127.0.0.1", func(c net.Conn) {
		io.Copy(io.Discard, c)
		select {
		case <-held:
		case <-time.After(30 * time.Second):
		}
	})
	t.Cleanup(func() { close(held) }) // before the backend's own clean-up, which waits for its handlers
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
	for i, p := range []*proc{a.proc, s.proc} {
		if i == 1 {
			// The first agent is gone; the server's case needs another.
			s.startAgent(t, "a2", "")
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, err := s.egressDialer(t).bounded()(ctx, "tcp", backend.addr())
		cancel()
		if err != nil {
			t.Fatalf("dial through the tunnel: %v", err)
		}
		cw, ok := c.(interface{ CloseWrite() error })
		if !ok {
			t.Fatalf("the dialer's connection (%T) cannot half-close", c)
		}
		if err := cw.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		// The server must have read the half-close before the restart:
		// one still unread in its socket goes to the next image with the
		// tunnel (a pause is byte-exact), and nothing holds the drain.
		waitFor(t, 5*time.Second, "the server reads the client's half-close", func() bool {
			return metricValue(t, metricsURL, srvPrefix+"stream_packets_total", "segment", "from_client", "packet_type", "CLOSE_REQ") >= float64(i+1)
		})
		p.signal(t, syscall.SIGHUP)
		waitFor(t, 5*time.Second, p.name+" starts draining for the restart", func() bool {
			return strings.Contains(p.out.String(), "restarting in place: draining tunnels")
		})
		p.signal(t, syscall.SIGTERM)
		start := time.Now()
		select {
		case <-p.done:
		case <-time.After(8 * time.Second):
			t.Fatalf("%s still running 8s after SIGTERM during a restart drain (3s):\n%s", p.name, p.out.String())
		}
		c.Close()
		if strings.Contains(p.out.String(), "re-executing in place") {
			t.Fatalf("%s re-executed after a SIGTERM during the drain:\n%s", p.name, p.out.String())
		}
		if !strings.Contains(p.out.String(), "exiting instead of re-executing") {
			t.Fatalf("%s: no log of the stop during the drain:\n%s", p.name, p.out.String())
		}
		t.Logf("%s exited %v after SIGTERM during the restart drain (%v)", p.name, time.Since(start).Round(10*time.Millisecond), p.waitErr)
	}
}
