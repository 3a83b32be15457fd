package e2e

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/spinifex/konnectivity/internal/testnet"
)

// Backends the tests reach through the tunnel. All listen on loopback and
// are closed by t.Cleanup together with every connection they accepted.

// startHTTPBackend serves:
//
//	GET  /hello?i=N   → "hello <name> N"
//	POST /echo        → the request body
//	GET  /big?n=N     → N bytes of pattern(N)
func startHTTPBackend(t *testing.T, host, name string) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /hello", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello %s %s", name, r.URL.Query().Get("i"))
	})
	mux.HandleFunc("POST /echo", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(w, r.Body)
	})
	mux.HandleFunc("GET /big", func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.Atoi(r.URL.Query().Get("n"))
		if err != nil || n < 0 || n > 64<<20 {
			http.Error(w, "bad n", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(n))
		_, _ = w.Write(pattern(n))
	})
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatalf("listen %s: %v", host, err)
	}
	srv := httptest.NewUnstartedServer(mux)
	srv.Listener.Close()
	srv.Listener = l
	srv.Start()
	t.Cleanup(srv.Close)
	return l.Addr().String()
}

// pattern returns n deterministic, non-repeating-at-small-period bytes.
func pattern(n int) []byte {
	b := make([]byte, n)
	var x uint32 = 2463534242
	for i := range b {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b[i] = byte(x)
	}
	return b
}

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// tcpBackend runs handle for every accepted connection until the test ends.
type tcpBackend struct{ *testnet.Server }

func startTCPBackend(t *testing.T, host string, handle func(net.Conn)) *tcpBackend {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatalf("listen %s: %v", host, err)
	}
	b := &tcpBackend{testnet.Serve(l, handle)}
	t.Cleanup(b.Close)
	return b
}

func (b *tcpBackend) addr() string { return b.Addr() }

// active is the number of accepted connections whose handler still runs.
func (b *tcpBackend) active() int { return b.Active() }

// echoHandler copies everything back and half-closes when the client does.
func echoHandler(c net.Conn) {
	_, _ = io.Copy(c, c)
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	}
}

// drainThenReplyHandler reads until EOF (the client's half-close), then
// answers "<n> <sha256>\n" followed by replyLen bytes of pattern and closes.
func drainThenReplyHandler(replyLen int) func(net.Conn) {
	return func(c net.Conn) {
		in, err := io.ReadAll(c)
		if err != nil {
			return
		}
		if _, err := fmt.Fprintf(c, "%d %s\n", len(in), sha(in)); err != nil {
			return
		}
		_, _ = c.Write(pattern(replyLen))
	}
}

// firehoseHandler waits for one byte from the client, then writes
// continuously until the write fails, counting bytes in *written. It waits
// because kube-apiserver's dialer rejects a tunnel whose target spoke
// before the client (it only proxies client-first protocols such as TLS).
func firehoseHandler(written *atomic.Int64) func(net.Conn) {
	chunk := pattern(32 << 10)
	return func(c net.Conn) {
		var start [1]byte
		if _, err := io.ReadFull(c, start[:]); err != nil {
			return
		}
		for {
			n, err := c.Write(chunk)
			written.Add(int64(n))
			if err != nil {
				return
			}
		}
	}
}
