//lint:file-ignore SA1019 the test client uses x/net/http2's Transport for HTTP/2 with prior knowledge, as kube-apiserver's gRPC client does.

package tunneltest

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// GRPCCall is one /ProxyService/Proxy call made by a minimal client.
type GRPCCall struct {
	t      *testing.T
	Send   *io.PipeWriter
	respCh chan *http.Response
	resp   *http.Response
	buf    []byte
}

// response waits for the response headers. Like grpc-go, the client sends
// its first message without waiting for them.
func (c *GRPCCall) response() *http.Response {
	c.t.Helper()
	if c.resp == nil {
		select {
		case c.resp = <-c.respCh:
		case <-time.After(15 * time.Second):
			c.t.Fatal("no response headers")
		}
		if c.resp == nil {
			c.t.Fatal("RoundTrip failed")
		}
	}
	return c.resp
}

func OpenGRPC(t *testing.T, sock, method string) *GRPCCall {
	t.Helper()
	return OpenGRPCOn(t, GRPCTransport(sock), method)
}

// GRPCTransport makes HTTP/2 connections with prior knowledge to sock; its
// calls share one connection while it takes them. Its writes queue
// (queuedConn), so that its reader never waits for the socket: grpc-go's
// reader does not either.
func GRPCTransport(sock string) *http2.Transport {
	return &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, "unix", sock)
			if err != nil {
				return nil, err
			}
			return newQueuedConn(c), nil
		},
	}
}

// queuedConn is a client connection whose writes never wait for the
// socket: they queue, and one goroutine writes them in order, as grpc-go
// queues its frames for its writer. x/net/http2's Transport writes its
// window updates from its read loop under the lock a request body's write
// holds while the socket is full: once a call's upload fills the socket
// and the server stops reading it (a pause), that client stops reading
// too, the server cannot deliver the call's last bytes, and the pause
// fails, as docs/restart.md says of such a client. The front door's tests
// need a client that reads while its upload waits, kube-apiserver's kind.
// What queues is bounded by the windows the server granted.
type queuedConn struct {
	net.Conn
	mu    sync.Mutex    // guards q, err, shut
	q     [][]byte      // written in order by the writer goroutine
	err   error         // the socket's first write error, returned from then on
	shut  bool          // Close was called
	wake  chan struct{} // one token: q grew or shut was set
	ended chan struct{} // closed once the writer goroutine returned
}

func newQueuedConn(c net.Conn) *queuedConn {
	q := &queuedConn{Conn: c, wake: make(chan struct{}, 1), ended: make(chan struct{})}
	go q.writer()
	return q
}

func (q *queuedConn) Write(p []byte) (int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.err != nil {
		return 0, q.err
	}
	if q.shut {
		return 0, net.ErrClosed
	}
	q.q = append(q.q, append([]byte(nil), p...))
	q.poke()
	return len(p), nil
}

func (q *queuedConn) poke() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *queuedConn) writer() {
	defer close(q.ended)
	for range q.wake {
		q.mu.Lock()
		todo, shut := q.q, q.shut
		q.q = nil
		q.mu.Unlock()
		for _, b := range todo {
			if _, err := q.Conn.Write(b); err != nil {
				q.mu.Lock()
				q.err = err
				q.mu.Unlock()
				return
			}
		}
		if shut {
			return
		}
	}
}

// Close ends the socket and the writer goroutine; what was still queued
// fails to write on the closed socket and is dropped.
func (q *queuedConn) Close() error {
	q.mu.Lock()
	q.shut = true
	q.poke()
	q.mu.Unlock()
	err := q.Conn.Close()
	<-q.ended
	return err
}

// OpenGRPCOn opens a call on tr.
func OpenGRPCOn(t *testing.T, tr *http2.Transport, method string) *GRPCCall {
	t.Helper()
	pr, pw := io.Pipe()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://konnectivity"+method, pr)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("Te", "trailers")
	c := &GRPCCall{t: t, Send: pw, respCh: make(chan *http.Response, 1)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Logf("RoundTrip: %v", err)
		}
		c.respCh <- resp
	}()
	t.Cleanup(func() {
		pw.Close()
		cancel()
		<-done
		if c.resp != nil {
			c.resp.Body.Close()
		}
		tr.CloseIdleConnections()
	})
	return c
}

func (c *GRPCCall) Write(p grpcwire.Packet) {
	c.t.Helper()
	if _, err := c.Send.Write(grpcwire.AppendMessage(nil, p)); err != nil {
		c.t.Fatal(err)
	}
}

func (c *GRPCCall) Read() (grpcwire.Packet, error) {
	msg, buf, err := grpcwire.ReadMessage(c.response().Body, c.buf, grpcwire.MaxMessageLen)
	c.buf = buf
	if err != nil {
		return grpcwire.Packet{}, err
	}
	return grpcwire.Decode(msg)
}

func (c *GRPCCall) Status() string {
	resp := c.response()
	io.Copy(io.Discard, resp.Body)
	if s := resp.Header.Get("Grpc-Status"); s != "" {
		return s // trailers-only
	}
	return resp.Trailer.Get("Grpc-Status")
}
