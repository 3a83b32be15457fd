package e2e

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

const established = "HTTP/1.1 200 Connection Established\r\n\r\n"

// rawUDS opens a unix connection to the server frontend with an overall
// deadline.
func rawUDS(t *testing.T, s *server) *net.UnixConn {
	t.Helper()
	c, err := net.DialTimeout("unix", s.sock, 5*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", s.sock, err)
	}
	t.Cleanup(func() { c.Close() })
	if err := c.SetDeadline(time.Now().Add(15 * time.Second)); err != nil {
		t.Fatal(err)
	}
	return c.(*net.UnixConn)
}

// connectHead is byte for byte what kube-apiserver's HTTPConnect dialer
// sends.
func connectHead(addr string) string {
	return fmt.Sprintf("CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", addr)
}

// readExactly reads len(want) bytes and compares.
func readExactly(t *testing.T, r io.Reader, want string) {
	t.Helper()
	got := make([]byte, len(want))
	n, err := io.ReadFull(r, got)
	if err != nil || string(got) != want {
		t.Fatalf("read %q (err %v), want %q", got[:n], err, want)
	}
}

// TestConnectWire speaks the frontend protocol on the raw unix socket.
func TestConnectWire(t *testing.T) {
	s := startServer(t)
	s.startAgent(t, "a1", "")
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)

	t.Run("socket-mode", func(t *testing.T) {
		fi, err := os.Stat(s.sock)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
			t.Fatalf("%s: mode %v, want a socket with 0600 (--uds-mode default)", s.sock, fi.Mode())
		}
	})

	t.Run("exact-200-and-nothing-more", func(t *testing.T) {
		c := rawUDS(t, s)
		if _, err := io.WriteString(c, connectHead(echo.addr())); err != nil {
			t.Fatal(err)
		}
		readExactly(t, c, established)
		// The echo backend is silent until spoken to, so any byte now
		// would be a body or header junk after the 200, which
		// kube-apiserver rejects ("unexpected N bytes of buffered data").
		if err := c.SetReadDeadline(time.Now().Add(500 * time.Millisecond)); err != nil {
			t.Fatal(err)
		}
		var one [1]byte
		n, err := c.Read(one[:])
		if n > 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("after the 200, before the client spoke: read %d bytes %q err %v; want nothing", n, one[:n], err)
		}
		if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(c, "hello\n"); err != nil {
			t.Fatal(err)
		}
		readExactly(t, c, "hello\n")
	})

	t.Run("bytes-behind-connect-head", func(t *testing.T) {
		c := rawUDS(t, s)
		// One write: the payload arrives in the same segment as the head
		// and must not be lost in the server's header buffer.
		if _, err := io.WriteString(c, connectHead(echo.addr())+"early bytes\n"); err != nil {
			t.Fatal(err)
		}
		readExactly(t, c, established+"early bytes\n")
	})

	t.Run("not-connect-405", func(t *testing.T) {
		c := rawUDS(t, s)
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("read response to GET: %v", err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusMethodNotAllowed {
			t.Fatalf("GET on the frontend: status %q, want 405", resp.Status)
		}
	})

	t.Run("garbage-400", func(t *testing.T) {
		c := rawUDS(t, s)
		if _, err := io.WriteString(c, "this is not http at all\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("read response to garbage: %v", err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("garbage on the frontend: status %q, want 400", resp.Status)
		}
	})

	t.Run("closed-port-502-with-reason", func(t *testing.T) {
		c := rawUDS(t, s)
		if _, err := io.WriteString(c, connectHead(closedPort(t))); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
		if err != nil {
			t.Fatalf("read response: %v", err)
		}
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadGateway {
			t.Fatalf("CONNECT to closed port: status %q body %q, want 502", resp.Status, body)
		}
		if len(bytes.TrimSpace(body)) == 0 {
			t.Errorf("502 without the agent's dial error in the body")
		}
		t.Logf("502 body: %q", body)
	})

	t.Run("half-close", func(t *testing.T) {
		const replyLen = 1 << 20
		backend := startTCPBackend(t, "127.0.0.1", drainThenReplyHandler(replyLen))
		c := rawUDS(t, s)
		if _, err := io.WriteString(c, connectHead(backend.addr())); err != nil {
			t.Fatal(err)
		}
		readExactly(t, c, established)
		payload := pattern(300 << 10)
		if _, err := c.Write(payload); err != nil {
			t.Fatal(err)
		}
		// The backend only answers after it sees EOF, so the reply proves
		// the half-close travelled client → server → agent → backend,
		// and the read side stayed open in the other direction.
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		reply, err := io.ReadAll(c)
		if err != nil {
			t.Fatalf("read reply after CloseWrite: %v (got %d bytes)", err, len(reply))
		}
		wantHead := fmt.Sprintf("%d %s\n", len(payload), sha(payload))
		head, rest, ok := strings.Cut(string(reply), "\n")
		if !ok || head+"\n" != wantHead {
			t.Fatalf("reply head %q, want %q", head, wantHead)
		}
		if len(rest) != replyLen || !bytes.Equal([]byte(rest), pattern(replyLen)) {
			t.Fatalf("reply body: %d bytes, want %d bytes of pattern", len(rest), replyLen)
		}
	})
}
