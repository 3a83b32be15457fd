//lint:file-ignore SA1019 the gRPC dialer uses x/net/http2's Transport for HTTP/2 with prior knowledge, one connection per dial as konnectivity-client does.

package tunnel

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"golang.org/x/net/http2"
)

func TestActivityOrder(t *testing.T) {
	var a activity
	a.down()
	if v := a.v.Load(); v&1 != 1 {
		t.Fatalf("after down: %b, want last toward the client", v)
	}
	v := a.v.Load()
	a.up()
	if w := a.v.Load(); w&1 != 0 || w == v {
		t.Fatalf("after up: %b (was %b), want changed and last from the client", w, v)
	}
	v = a.v.Load()
	a.up()
	a.down()
	a.down()
	if w := a.v.Load(); w&1 != 1 || w>>1 != v>>1+3 {
		t.Fatalf("after up, down, down: %b (was %b)", w, v)
	}
}

// handoverListener lets a listener outlive the Server that serves it, as
// a self-restart hands its listeners to the next image: Close stops
// Accept but keeps the socket listening, so clients queue in the backlog
// until next serves it.
type handoverListener struct {
	*net.UnixListener
	closed atomic.Bool
}

func (l *handoverListener) Accept() (net.Conn, error) {
	c, err := l.UnixListener.Accept()
	if err != nil && l.closed.Load() {
		return nil, net.ErrClosed
	}
	return c, err
}

func (l *handoverListener) Close() error {
	l.closed.Store(true)
	return l.UnixListener.SetDeadline(time.Now())
}

func (l *handoverListener) next() *handoverListener {
	l.UnixListener.SetDeadline(time.Time{})
	return &handoverListener{UnixListener: l.UnixListener}
}

// tunnelDialer dials through a frontend the way kube-apiserver's egress
// dialer does: an HTTP CONNECT on the Unix socket, or one gRPC call per
// dial on a connection of its own (konnectivity-client's single-use
// tunnel), whose CLOSE_RSP reads as EOF.
func tunnelDialer(sock string, grpc bool) func(ctx context.Context, network, addr string) (net.Conn, error) {
	if grpc {
		return func(ctx context.Context, _, addr string) (net.Conn, error) { return dialGRPCTunnel(ctx, sock, addr) }
	}
	return func(ctx context.Context, _, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, "unix", sock)
		if err != nil {
			return nil, err
		}
		fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", addr, addr)
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			c.Close()
			return nil, err
		}
		if resp.StatusCode != 200 {
			c.Close()
			return nil, fmt.Errorf("CONNECT: %s", resp.Status)
		}
		return &bufferedClientConn{Conn: c, br: br}, nil
	}
}

type bufferedClientConn struct {
	net.Conn
	br *bufio.Reader
}

func (c *bufferedClientConn) Read(p []byte) (int, error) { return c.br.Read(p) }

// grpcTunnelConn is a dial through the gRPC front door as a net.Conn.
type grpcTunnelConn struct {
	tr     *http2.Transport
	send   *io.PipeWriter
	body   io.ReadCloser
	id     int64
	cancel context.CancelFunc
	buf    []byte
	rest   []byte
	wmu    sync.Mutex
	once   sync.Once
}

func dialGRPCTunnel(ctx context.Context, sock, addr string) (net.Conn, error) {
	tr := &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, _, _ string, _ *tls.Config) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}
	pr, pw := io.Pipe()
	cctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(cctx, http.MethodPost, "http://konnectivity"+grpcProxyMethod, pr)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("Te", "trailers")
	go pw.Write(grpcwire.AppendMessage(nil, grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: addr, Random: 1}))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		cancel()
		pw.Close()
		tr.CloseIdleConnections()
		return nil, fmt.Errorf("gRPC call: %w", err)
	}
	c := &grpcTunnelConn{tr: tr, send: pw, body: resp.Body, cancel: cancel}
	msg, buf, err := grpcwire.ReadMessage(resp.Body, nil, grpcwire.MaxMessageLen)
	c.buf = buf
	var rsp grpcwire.Packet
	if err == nil {
		rsp, err = grpcwire.Decode(msg)
	}
	if err == nil && (rsp.Type != grpcwire.DialRsp || rsp.Error != "") {
		err = fmt.Errorf("DIAL_RSP %s: %s", rsp.Type, rsp.Error)
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	c.id = rsp.ConnectID
	return c, nil
}

func (c *grpcTunnelConn) Read(p []byte) (int, error) {
	for len(c.rest) == 0 {
		msg, buf, err := grpcwire.ReadMessage(c.body, c.buf, grpcwire.MaxMessageLen)
		c.buf = buf
		if err != nil {
			return 0, err
		}
		pkt, err := grpcwire.Decode(msg)
		if err != nil {
			return 0, err
		}
		switch pkt.Type {
		case grpcwire.Data:
			c.rest = pkt.Data
		case grpcwire.CloseRsp:
			return 0, io.EOF
		}
	}
	n := copy(p, c.rest)
	c.rest = c.rest[n:]
	return n, nil
}

func (c *grpcTunnelConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if _, err := c.send.Write(grpcwire.AppendMessage(nil, grpcwire.Packet{Type: grpcwire.Data, ConnectID: c.id, Data: p})); err != nil {
		return 0, fmt.Errorf("gRPC DATA: %w", err)
	}
	return len(p), nil
}

func (c *grpcTunnelConn) Close() error {
	c.once.Do(func() {
		c.send.Close()
		c.cancel()
		c.body.Close()
		c.tr.CloseIdleConnections()
	})
	return nil
}

func (c *grpcTunnelConn) LocalAddr() net.Addr              { return &net.UnixAddr{Net: "unix"} }
func (c *grpcTunnelConn) RemoteAddr() net.Addr             { return &net.UnixAddr{Net: "unix"} }
func (c *grpcTunnelConn) SetDeadline(time.Time) error      { return nil }
func (c *grpcTunnelConn) SetReadDeadline(time.Time) error  { return nil }
func (c *grpcTunnelConn) SetWriteDeadline(time.Time) error { return nil }

// TestShutdownClosesIdleKeepAlivesQuietly is a drain in the middle of a
// loop of POSTs (not retried by an HTTP client) over keep-alive
// connections through the tunnel, as kube-apiserver calls its webhooks,
// for the tunnels a restart does not hand over (handover.go): the
// draining server closes each keep-alive tunnel in a pause after a
// response, the client dials again and reaches the next server on the
// handed-over listener. The drain ends long before its deadline. A call
// the client starts in the instant of the close is lost (the race every
// keep-alive server has, and the reason restarts hand tunnels over); at
// most one is allowed, and it is logged.
func TestShutdownClosesIdleKeepAlivesQuietly(t *testing.T) {
	for _, mode := range []string{"http-connect", "grpc"} {
		t.Run(mode, func(t *testing.T) { testQuietRestart(t, mode == "grpc") })
	}
}

func testQuietRestart(t *testing.T, grpc bool) {
	checkNoLeaks(t)
	quiet := drainQuiet
	if grpc {
		quiet = drainQuietGRPC
	}
	p := newPKI(t)
	agentLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	agentAddr := agentLn.Addr().String()
	dir, err := os.MkdirTemp("", "quiet")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "f.sock")
	uln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer uln.Close()
	front := &handoverListener{UnixListener: uln.(*net.UnixListener)}

	startServer := func(id string, front *handoverListener, agents net.Listener) (*Server, *sync.WaitGroup) {
		srv, err := NewServer(ServerConfig{
			ID:          id,
			AgentTLS:    &tls.Config{Certificates: []tls.Certificate{p.serverCert}, ClientCAs: p.pool, ClientAuth: tls.RequireAndVerifyClientCert},
			AgentWait:   5 * time.Second, // the next server waits for the agent to come back
			DialTimeout: 3 * time.Second,
			Logger:      testLogger(t),
		})
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			if grpc {
				srv.ServeGRPC(front)
			} else {
				srv.ServeFrontend(front)
			}
		}()
		go func() { defer wg.Done(); srv.ServeAgents(agents) }()
		return srv, &wg
	}
	srv1, wg1 := startServer("s1", front, agentLn)
	defer srv1.Close()
	ag := startAgentTo(t, p, []string{agentAddr}, "a1", "", func(c *AgentConfig) {
		c.SyncInterval, c.SyncCap = 20*time.Millisecond, 100*time.Millisecond
	})
	defer ag.stop()
	waitFor := func(what string, ok func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	waitFor("the agent", func() bool { return srv1.AgentCount() == 1 })

	// The webhook: answers each POST with its body.
	var answered atomic.Int64
	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		answered.Add(1)
		w.Write(b)
	})}
	go hs.Serve(hl)
	defer hs.Close()
	url := "http://" + hl.Addr().String() + "/validate"

	var dials atomic.Int64
	dial := tunnelDialer(sock, grpc)
	tr := &http.Transport{
		DialContext: func(ctx context.Context, n, a string) (net.Conn, error) {
			dials.Add(1)
			return dial(ctx, n, a)
		},
		MaxIdleConnsPerHost: 4,
	}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 15 * time.Second}

	var ok, failed atomic.Int64
	var mu sync.Mutex
	var errs []string
	stop := make(chan struct{})
	var workers sync.WaitGroup
	for w := range 3 {
		workers.Add(1)
		go func() {
			defer workers.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				body := fmt.Sprintf("call %d/%d", w, i)
				resp, err := client.Post(url, "text/plain", strings.NewReader(body))
				var got []byte
				if err == nil {
					got, err = io.ReadAll(resp.Body)
					resp.Body.Close()
				}
				if err == nil && string(got) == body {
					ok.Add(1)
				} else {
					failed.Add(1)
					mu.Lock()
					errs = append(errs, fmt.Sprintf("%s: %q %v", body, got, err))
					mu.Unlock()
				}
				// Pauses as between kube-apiserver's calls: mostly
				// well inside the quiet interval, now and then well
				// beyond it. (A call that starts within the moment the
				// client needs to see its idle connection closed is the
				// race every keep-alive server has; not measured here.)
				if rand.IntN(4) == 0 {
					time.Sleep(2*quiet + time.Duration(rand.IntN(int(2*quiet))))
				} else {
					time.Sleep(time.Duration(rand.IntN(int(quiet / 2))))
				}
			}
		}()
	}
	time.Sleep(300 * time.Millisecond)

	// The restart: the first server drains with a long grace while the
	// next one takes the listeners over once it is done.
	const grace = 20 * time.Second
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	err = srv1.Shutdown(ctx)
	cancel()
	drain := time.Since(began)
	wg1.Wait()
	if err != nil {
		t.Errorf("Shutdown: %v after %v", err, drain)
	}
	agentLn2, err := net.Listen("tcp", agentAddr)
	if err != nil {
		t.Fatal(err)
	}
	srv2, wg2 := startServer("s1", front.next(), agentLn2)
	defer func() { srv2.Close(); wg2.Wait() }()
	waitFor("the agent on the next server", func() bool { return srv2.AgentCount() == 1 })
	okBefore := ok.Load()
	time.Sleep(500 * time.Millisecond)
	close(stop)
	workers.Wait()
	tr.CloseIdleConnections()

	t.Logf("drain took %v, %d tunnels closed at a quiet moment; %d calls ok (%d after the restart), %d failed, %d dials, webhook answered %d",
		drain, srv1.Stats.ClosedQuiet.Load(), ok.Load(), ok.Load()-okBefore, failed.Load(), dials.Load(), answered.Load())
	switch {
	case failed.Load() > 1:
		t.Errorf("%d calls lost across the restart: %s", failed.Load(), strings.Join(errs[:min(len(errs), 5)], "; "))
	case failed.Load() == 1:
		t.Logf("one call raced the quiet close: %s", errs[0])
	}
	if srv1.Stats.ClosedQuiet.Load() == 0 {
		t.Error("no tunnel was closed at a quiet moment")
	}
	if drain > grace/2 {
		t.Errorf("drain took %v of a %v grace: idle keep-alive tunnels waited for the deadline", drain, grace)
	}
	if ok.Load() == okBefore {
		t.Error("no call went through the next server")
	}
}

// TestShutdownCutsStreamingTunnelAtDeadline: a tunnel that never goes
// quiet (a destination streaming without pause, as a log follow) is cut at
// the deadline, not at a quiet moment, while an idle keep-alive tunnel
// next to it closes early.
func TestShutdownCutsStreamingTunnelAtDeadline(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.waitAgents(1)
	stream := serveTCP(t, func(c net.Conn) {
		chunk := bytes.Repeat([]byte("log line\n"), 100)
		for {
			if _, err := c.Write(chunk); err != nil {
				return
			}
			time.Sleep(200 * time.Microsecond)
		}
	})
	idle := e.echoOne(echoServer(t)) // a byte there and back: the last went to the client
	defer idle.Close()
	sc, br, resp := e.connect(stream)
	defer sc.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %s", resp.Status)
	}
	sc.SetDeadline(time.Time{})
	idle.SetDeadline(time.Time{})
	streamEnded := make(chan time.Time, 1)
	go func() {
		io.Copy(io.Discard, br)
		streamEnded <- time.Now()
	}()
	idleEnded := make(chan time.Time, 1)
	go func() {
		io.Copy(io.Discard, idle)
		idleEnded <- time.Now()
	}()

	const grace = 3 * time.Second
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	err := e.srv.Shutdown(ctx)
	if err != nil && !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown: %v", err)
	}
	select {
	case at := <-idleEnded:
		if d := at.Sub(began); d > time.Second {
			t.Errorf("idle tunnel closed %v into the drain, want at a quiet moment soon after it began", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("idle tunnel never closed")
	}
	select {
	case at := <-streamEnded:
		if d := at.Sub(began); d < grace-100*time.Millisecond {
			t.Errorf("streaming tunnel ended %v into a %v drain, before the deadline", d, grace)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("streaming tunnel never cut")
	}
	if n := e.srv.Stats.ClosedQuiet.Load(); n < 1 {
		t.Errorf("%d tunnels closed at a quiet moment, want the idle one", n)
	}
}

// TestDrainWaitsForHalfClosedTunnel: a tunnel whose client finished
// sending is waiting for the rest of an answer, however long the answer
// pauses: a drain does not close it at a quiet moment (it closes an idle
// keep-alive tunnel in the same sweep), and the answer arrives whole.
func TestDrainWaitsForHalfClosedTunnel(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.waitAgents(1)
	more := make(chan struct{})
	dest := serveTCP(t, func(c net.Conn) {
		defer c.Close()
		io.Copy(io.Discard, c) // to the client's half-close
		c.Write([]byte("a"))
		<-more // the answer pauses
		c.Write([]byte("b"))
	})
	halfClosed, br, resp := e.connect(dest)
	defer halfClosed.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %s", resp.Status)
	}
	if _, err := halfClosed.Write([]byte("request")); err != nil {
		t.Fatal(err)
	}
	halfClosed.(*net.UnixConn).CloseWrite()
	if b, err := br.ReadByte(); err != nil || b != 'a' {
		t.Fatalf("first part of the answer: %q %v", b, err)
	}
	echo, _ := countingEcho(t)
	idle := e.echoOne(echo) // quiet since after the other tunnel's last byte
	defer idle.Close()

	shut := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		shut <- e.srv.Shutdown(ctx)
	}()
	if _, err := idle.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("idle keep-alive tunnel during the drain: %v, want EOF (closed at a quiet moment)", err)
	}
	if n := e.srv.Stats.ClosedQuiet.Load(); n != 1 {
		t.Errorf("%d tunnels closed at a quiet moment, want 1 (the idle one)", n)
	}
	close(more)
	rest, err := io.ReadAll(br)
	if err != nil || string(rest) != "b" {
		t.Fatalf("rest of the answer: %q %v, want \"b\"", rest, err)
	}
	if err := <-shut; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
}
