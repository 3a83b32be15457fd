package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"
)

// waitFor polls cond until it is true, failing after bound.
func waitFor(t *testing.T, bound time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(pollInterval)
	}
}

// echoOnce writes line and expects it back.
func echoOnce(c net.Conn, br *bufio.Reader, line string) error {
	if _, err := io.WriteString(c, line); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	got, err := br.ReadString('\n')
	if err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if got != line {
		return fmt.Errorf("echo %q, want %q", got, line)
	}
	return nil
}

// TestTunnelClose: closing either end of a tunnel reaches the other end,
// so neither the agent nor the backend keeps connections behind.
func TestTunnelClose(t *testing.T) {
	s := startServer(t)
	s.startAgent(t, "a1", "")
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	d := s.egressDialer(t).bounded()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	t.Run("client-close-releases-backend", func(t *testing.T) {
		const n = 50
		conns := make([]net.Conn, 0, n)
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for i := range n {
			c, err := d(ctx, "tcp", echo.addr())
			if err != nil {
				t.Fatalf("dial %d: %v", i, err)
			}
			conns = append(conns, c)
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			if err := echoOnce(c, bufio.NewReader(c), fmt.Sprintf("tunnel %d\n", i)); err != nil {
				t.Fatalf("tunnel %d: %v", i, err)
			}
		}
		if got := echo.active(); got != n {
			t.Fatalf("backend sees %d connections, want %d", got, n)
		}
		for _, c := range conns {
			c.Close()
		}
		conns = nil
		waitFor(t, 10*time.Second, "backend connections closed after the clients closed their tunnels",
			func() bool { return echo.active() == 0 })
	})

	t.Run("backend-close-reaches-client", func(t *testing.T) {
		once := startTCPBackend(t, "127.0.0.1", func(c net.Conn) {
			line, err := bufio.NewReader(c).ReadString('\n')
			if err != nil {
				return
			}
			_, _ = io.WriteString(c, "bye "+line)
			// The handler returns and the backend closes the connection.
		})
		c, err := d(ctx, "tcp", once.addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(c, "x\n"); err != nil {
			t.Fatal(err)
		}
		// The client never half-closes; ReadAll ends only if the
		// backend's close travels back as EOF.
		got, err := io.ReadAll(c)
		if err != nil {
			t.Fatalf("read until EOF: %v (got %q)", err, got)
		}
		if string(got) != "bye x\n" {
			t.Fatalf("got %q", got)
		}
	})
}

// TestAgentReconnects: the agent finds its way back after the server
// restarts, and the server notices an agent that died.
func TestAgentReconnects(t *testing.T) {
	s := startServer(t)
	a := s.startAgent(t, "a1", "")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialer(t)
	checkReachable(t, d, backend, "b1", 3)

	t.Run("server-restart", func(t *testing.T) {
		s.proc.stop(t)
		s.launch(t)
		waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
		waitHTTP(t, s.proc, s.healthURL("/readyz"), http.StatusOK)
		checkReachable(t, d, backend, "b1", 3)
	})

	t.Run("agent-killed", func(t *testing.T) {
		a.proc.signal(t, syscall.SIGKILL)
		waitHTTP(t, s.proc, s.healthURL("/readyz"), http.StatusServiceUnavailable)
		s.startAgent(t, "a1-new", "")
		checkReachable(t, d, backend, "b1", 3)
	})
}

// TestServerGracefulShutdown: on SIGTERM an open tunnel keeps working
// during --graceful-shutdown-timeout, then the server closes it and exits
// with status 0.
func TestServerGracefulShutdown(t *testing.T) {
	s := startServer(t, "--graceful-shutdown-timeout=2s")
	s.startAgent(t, "a1", "")
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := s.egressDialer(t).bounded()(ctx, "tcp", echo.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(c)
	if err := echoOnce(c, br, "before\n"); err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	s.proc.signal(t, syscall.SIGTERM)
	if err := echoOnce(c, br, "during grace\n"); err != nil {
		t.Errorf("open tunnel right after SIGTERM: %v", err)
	}
	select {
	case <-s.proc.done:
	case <-time.After(2*time.Second + stopTimeout):
		t.Fatalf("server still running %v after SIGTERM with --graceful-shutdown-timeout=2s", time.Since(start))
	}
	t.Logf("server exited %v after SIGTERM: %v", time.Since(start).Round(time.Millisecond), s.proc.waitErr)
	if s.proc.waitErr != nil {
		t.Errorf("server exit after SIGTERM: %v, want status 0", s.proc.waitErr)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := io.Copy(io.Discard, br); err != nil {
		t.Errorf("tunnel after server exit: read %d bytes then %v, want EOF", n, err)
	}
}

// TestAgentAuthRejected: with --cluster-ca-cert the server must refuse an
// agent whose client certificate comes from another CA.
func TestAgentAuthRejected(t *testing.T) {
	s := startServer(t, "--agent-wait=1s")
	other := newPKI(t, t.TempDir())
	a := s.launchAgent(t, other, "intruder", "")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")

	// Let the agent try (it logs its failure); the dial then must find no
	// agent. Checking readiness a few times covers the agent's retries.
	for range 4 {
		time.Sleep(300 * time.Millisecond)
		if a.proc.exited() {
			break
		}
		if got := getStatus(t, s.healthURL("/readyz")); got != http.StatusServiceUnavailable {
			t.Fatalf("server /readyz = %d with only a foreign-CA agent, want 503", got)
		}
	}
	el, err := dialErr(t, s.egressDialer(t), backend, 10*time.Second)
	if err == nil {
		t.Fatal("dial succeeded through an agent with a foreign-CA certificate")
	}
	if !strings.Contains(err.Error(), "code 503") {
		t.Errorf("dial with only a foreign-CA agent: %v, want \"code 503\"", err)
	}
	t.Logf("foreign-CA agent: dial → %v after %v", err, el.Round(time.Millisecond))
}
