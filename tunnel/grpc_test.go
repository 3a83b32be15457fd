//lint:file-ignore SA1019 the test client uses x/net/http2's Transport for HTTP/2 with prior knowledge, as kube-apiserver's gRPC client does.

package tunnel

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"golang.org/x/net/http2"
)

// grpcEnv serves the gRPC front door on a Unix socket next to an env.
func (e *env) grpcSocket(t testing.TB) string {
	dir, err := os.MkdirTemp("", "grpc")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "g.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	e.wg.Add(1)
	go func() { defer e.wg.Done(); e.srv.ServeGRPC(ln) }()
	t.Cleanup(func() { ln.Close(); os.RemoveAll(dir) })
	return path
}

// grpcCall is one /ProxyService/Proxy call made by a minimal client.
type grpcCall struct {
	t      *testing.T
	send   *io.PipeWriter
	respCh chan *http.Response
	resp   *http.Response
	buf    []byte
}

// response waits for the response headers. Like grpc-go, the client sends
// its first message without waiting for them.
func (c *grpcCall) response() *http.Response {
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

func openGRPC(t *testing.T, sock, method string) *grpcCall {
	t.Helper()
	return openGRPCOn(t, grpcTransport(sock), method)
}

// grpcTransport makes HTTP/2 connections with prior knowledge to sock; its
// calls share one connection while it takes them.
func grpcTransport(sock string) *http2.Transport {
	return &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}
}

// openGRPCOn opens a call on tr.
func openGRPCOn(t *testing.T, tr *http2.Transport, method string) *grpcCall {
	t.Helper()
	pr, pw := io.Pipe()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://konnectivity"+method, pr)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("Te", "trailers")
	c := &grpcCall{t: t, send: pw, respCh: make(chan *http.Response, 1)}
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

func (c *grpcCall) write(p grpcwire.Packet) {
	c.t.Helper()
	if _, err := c.send.Write(grpcwire.AppendMessage(nil, p)); err != nil {
		c.t.Fatal(err)
	}
}

func (c *grpcCall) read() (grpcwire.Packet, error) {
	msg, buf, err := grpcwire.ReadMessage(c.response().Body, c.buf, grpcwire.MaxMessageLen)
	c.buf = buf
	if err != nil {
		return grpcwire.Packet{}, err
	}
	return grpcwire.Decode(msg)
}

func (c *grpcCall) status() string {
	resp := c.response()
	io.Copy(io.Discard, resp.Body)
	if s := resp.Header.Get("Grpc-Status"); s != "" {
		return s // trailers-only
	}
	return resp.Trailer.Get("Grpc-Status")
}

func TestGRPCFrontendEcho(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.waitAgents(1)
	sock := e.grpcSocket(t)
	echo := echoServer(t)

	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := openGRPC(t, sock, grpcwire.ProxyMethod)
			c.write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: echo, Random: int64(100 + i)})
			rsp, err := c.read()
			if err != nil || rsp.Type != grpcwire.DialRsp || rsp.Random != int64(100+i) || rsp.ConnectID == 0 || rsp.Error != "" {
				t.Errorf("DIAL_RSP: %+v %v", rsp, err)
				return
			}
			payload := bytes.Repeat([]byte{byte(i)}, 100<<10)
			c.write(grpcwire.Packet{Type: grpcwire.Data, ConnectID: rsp.ConnectID, Data: payload})
			var got []byte
			for len(got) < len(payload) {
				p, err := c.read()
				if err != nil || p.Type != grpcwire.Data {
					t.Errorf("DATA: %+v %v", p.Type, err)
					return
				}
				got = append(got, p.Data...)
			}
			if !bytes.Equal(got, payload) {
				t.Error("echo mismatch")
			}
			c.write(grpcwire.Packet{Type: grpcwire.CloseReq, ConnectID: rsp.ConnectID})
			p, err := c.read()
			if err != nil || p.Type != grpcwire.CloseRsp || p.ConnectID != rsp.ConnectID {
				t.Errorf("CLOSE_RSP: %+v %v", p, err)
			}
			if s := c.status(); s != "0" {
				t.Errorf("grpc-status %q", s)
			}
		}()
	}
	wg.Wait()
}

func TestGRPCFrontendDialFailureAndBadInput(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.waitAgents(1)
	sock := e.grpcSocket(t)

	c := openGRPC(t, sock, grpcwire.ProxyMethod)
	c.write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: "127.0.0.1:1", Random: 5})
	rsp, err := c.read()
	if err != nil || rsp.Type != grpcwire.DialRsp || !strings.Contains(rsp.Error, "connection refused") {
		t.Fatalf("failed dial: %+v %v", rsp, err)
	}
	if s := c.status(); s != "0" {
		t.Fatalf("status %q", s)
	}

	c = openGRPC(t, sock, "/AgentService/Connect")
	if s := c.status(); s != "12" {
		t.Fatalf("unknown method: status %q, want 12", s)
	}
	c = openGRPC(t, sock, grpcwire.ProxyMethod)
	c.send.Write([]byte{0, 0, 0, 0, 3, 0xff, 0xff, 0xff})
	if s := c.status(); s != "3" {
		t.Fatalf("malformed protobuf: status %q, want 3", s)
	}
	c = openGRPC(t, sock, grpcwire.ProxyMethod)
	c.write(grpcwire.Packet{Type: grpcwire.Data, ConnectID: 1, Data: []byte("x")})
	if s := c.status(); s != "3" {
		t.Fatalf("DATA before DIAL_REQ: status %q, want 3", s)
	}
}

// DIAL_CLS cancels the pending dial on the agent too.
func TestGRPCDialCancelReachesAgent(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, func(c *ServerConfig) { c.DialTimeout = 10 * time.Second })
	cancelled := make(chan struct{})
	started := make(chan struct{})
	e.startAgent("a1", "", func(c *AgentConfig) {
		c.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
			close(started)
			<-ctx.Done()
			close(cancelled)
			return nil, ctx.Err()
		}
	})
	e.waitAgents(1)
	sock := e.grpcSocket(t)
	c := openGRPC(t, sock, grpcwire.ProxyMethod)
	c.write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: "192.0.2.1:443", Random: 9})
	<-started
	c.write(grpcwire.Packet{Type: grpcwire.DialCls, Random: 9})
	select {
	case <-cancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the agent's dial was not cancelled by DIAL_CLS")
	}
	c.send.Close()
	if _, err := c.read(); err != nil && !errors.Is(err, io.EOF) {
		t.Logf("after DIAL_CLS: %v", err)
	}
}

// TestIdleGRPCCallsParkOnlyTheirWaiter checks what an idle call on the
// gRPC front door keeps on the server: its waiter (waitGRPC), and no
// goroutine carrying either direction, nor the handler whose stack the
// dial grew. Half the calls echoed bytes both ways, half sent nothing
// after their DIAL_REQ (the upload's watcher has not seen a byte). Once
// the calls end, their waiters are gone too.
func TestIdleGRPCCallsParkOnlyTheirWaiter(t *testing.T) {
	checkNoLeaks(t)
	e, echo := newEchoEnv(t)
	defer e.stop()
	tr := grpcTransport(e.grpcSocket(t))
	const n = 20
	calls, ids := make([]*grpcCall, n), make([]int64, n)
	for i := range calls {
		c := openGRPCOn(t, tr, grpcwire.ProxyMethod)
		calls[i] = c
		c.write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: echo, Random: int64(i)})
		rsp, err := c.read()
		if err != nil || rsp.Type != grpcwire.DialRsp || rsp.Error != "" {
			t.Fatalf("DIAL_RSP: %+v %v", rsp, err)
		}
		ids[i] = rsp.ConnectID
		if i%2 == 1 {
			continue
		}
		c.write(grpcwire.Packet{Type: grpcwire.Data, ConnectID: ids[i], Data: []byte("ping")})
		if p, err := c.read(); err != nil || string(p.Data) != "ping" {
			t.Fatalf("echo: %+v %v", p, err)
		}
	}
	// parked counts the server's goroutines by what they run.
	parked := func() (waiters, others int) {
		buf := make([]byte, 1<<22)
		buf = buf[:runtime.Stack(buf, true)]
		for _, g := range strings.Split(string(buf), "\n\n") {
			switch {
			case strings.Contains(g, "tunnel.(*Server).waitGRPC"):
				waiters++
			case strings.Contains(g, "tunnel.(*carrier).run"), strings.Contains(g, "tunnel.(*grpcConn).ServeHTTP"):
				others++
			}
		}
		return waiters, others
	}
	settled := func(want int) (waiters, others int) {
		deadline := time.Now().Add(10 * time.Second)
		for {
			waiters, others = parked()
			if (waiters == want && others == 0) || time.Now().After(deadline) {
				return waiters, others
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if w, o := settled(n); w != n || o != 0 {
		t.Fatalf("%d idle calls: %d waiters and %d handlers or carriers on the server, want %d and 0", n, w, o, n)
	}
	for i, c := range calls {
		c.write(grpcwire.Packet{Type: grpcwire.CloseReq, ConnectID: ids[i]})
		if st := c.status(); st != "0" {
			t.Fatalf("call %d ended with status %q, want 0", i, st)
		}
	}
	if w, o := settled(0); w != 0 || o != 0 {
		t.Fatalf("%d calls ended: %d waiters and %d handlers or carriers left", n, w, o)
	}
}
