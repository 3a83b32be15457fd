//lint:file-ignore SA1019 the gRPC dialer uses x/net/http2's Transport for HTTP/2 with prior knowledge, one connection per dial as konnectivity-client does.

package server

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
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

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/net/http2"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

func TestActivityOrder(t *testing.T) {
	var a wire.Activity
	a.Down()
	if v := a.V.Load(); v&1 != 1 {
		t.Fatalf("after down: %b, want last toward the client", v)
	}
	v := a.V.Load()
	a.Up()
	if w := a.V.Load(); w&1 != 0 || w == v {
		t.Fatalf("after up: %b (was %b), want changed and last from the client", w, v)
	}
	v = a.V.Load()
	a.Up()
	a.Down()
	a.Down()
	if w := a.V.Load(); w&1 != 1 || w>>1 != v>>1+3 {
		t.Fatalf("after up, down, down: %b (was %b)", w, v)
	}
}

// TestActivityQuietAcrossHandover: the quiet a paused tunnel had is
// inherited by its resumed self, and a tunnel whose client spoke last
// has none.
func TestActivityQuietAcrossHandover(t *testing.T) {
	var a wire.Activity
	a.Down()
	a.At.Add(-int64(time.Second)) // the last write went a second ago
	q := a.QuietFor()
	if q < time.Second {
		t.Fatalf("quiet for %v, want at least 1s", q)
	}
	var b wire.Activity
	b.InheritQuiet(q)
	if got := b.QuietFor(); got < q || b.V.Load()&1 != 1 {
		t.Fatalf("resumed: quiet for %v (v %b), want at least %v and last toward the client", got, b.V.Load(), q)
	}
	a.Up()
	if q := a.QuietFor(); q != 0 {
		t.Fatalf("after a read from the client: quiet for %v, want 0", q)
	}
	var c wire.Activity
	c.InheritQuiet(0)
	if c.V.Load() != 0 || c.QuietFor() != 0 {
		t.Fatal("a tunnel paused while not quiet resumed as quiet")
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
	req, _ := http.NewRequestWithContext(cctx, http.MethodPost, "http://konnectivity"+grpcwire.ProxyMethod, pr)
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
	tunneltest.CheckNoLeaks(t)
	const grace = 20 * time.Second
	const short = 50 * time.Millisecond // gaps between one worker's calls, mostly
	quiet := quietNeeded(grace)         // the quiet the drain needs at its start
	p := tunneltest.NewPKI(t)
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
		srv, err := New(Config{
			ID:          id,
			AgentTLS:    &tls.Config{Certificates: []tls.Certificate{p.ServerCert}, ClientCAs: p.Pool, ClientAuth: tls.RequireAndVerifyClientCert},
			AgentWait:   5 * time.Second, // the next server waits for the agent to come back
			DialTimeout: 3 * time.Second,
			Logger:      tunneltest.Logger(t),
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
	ag := startAgentTo(t, p, []string{agentAddr}, "a1", "", func(c *agent.Config) {
		c.SyncInterval, c.SyncCap = 20*time.Millisecond, 100*time.Millisecond
	})
	defer ag.Stop()
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

	// Pauses as between kube-apiserver's calls: mostly well inside the
	// front door's short quiet, now and then well beyond the quiet a drain
	// needs at its start. (A call that starts within the moment the client
	// needs to see its idle connection closed is the race every keep-alive
	// server has; not measured here.)
	posts := startEchoPosts(t, client, url, 3, func() time.Duration {
		if rand.IntN(4) == 0 {
			return 2*quiet + time.Duration(rand.IntN(int(2*quiet)))
		}
		return time.Duration(rand.IntN(int(short / 2)))
	})
	time.Sleep(300 * time.Millisecond)

	// The restart: the first server drains with a long grace while the
	// next one takes the listeners over once it is done.
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
	okBefore := posts.ok.Load()
	waitFor("a call through the next server", func() bool { return posts.ok.Load() > okBefore })
	posts.stop()
	tr.CloseIdleConnections()

	t.Logf("drain took %v, %d tunnels closed at a quiet moment; %d calls ok (%d after the restart), %d failed, %d dials, webhook answered %d",
		drain, srv1.Stats.ClosedQuiet.Load(), posts.ok.Load(), posts.ok.Load()-okBefore, posts.failed.Load(), dials.Load(), answered.Load())
	posts.checkLost(t, "the restart")
	if srv1.Stats.ClosedQuiet.Load() == 0 {
		t.Error("no tunnel was closed at a quiet moment")
	}
	if drain > grace/2 {
		t.Errorf("drain took %v of a %v grace: idle keep-alive tunnels waited for the deadline", drain, grace)
	}
	if posts.ok.Load() == okBefore {
		t.Error("no call went through the next server")
	}
}

// echoPosts are workers that POST their own body to an echo handler back
// to back through one HTTP client, as kube-apiserver calls a webhook over
// keep-alive connections, and count each call ok or failed. stop owns
// their goroutines: a test calls it before its verdict, and a cleanup
// calls it for a test that ends early.
type echoPosts struct {
	ok, failed atomic.Int64
	mu         sync.Mutex
	errs       []string // guarded by mu: one per failed call
	quit       chan struct{}
	stopped    sync.Once // closes quit once
	wg         sync.WaitGroup
}

// startEchoPosts starts n workers POSTing to url through client, each
// sleeping pause() after every call.
func startEchoPosts(t *testing.T, client *http.Client, url string, n int, pause func() time.Duration) *echoPosts {
	p := &echoPosts{quit: make(chan struct{})}
	t.Cleanup(p.stop)
	for w := range n {
		p.wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-p.quit:
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
					p.ok.Add(1)
				} else {
					p.failed.Add(1)
					p.mu.Lock()
					p.errs = append(p.errs, fmt.Sprintf("%s: %q %v", body, got, err))
					p.mu.Unlock()
				}
				time.Sleep(pause())
			}
		})
	}
	return p
}

// stop ends the workers and waits for them to return.
func (p *echoPosts) stop() {
	p.stopped.Do(func() { close(p.quit) })
	p.wg.Wait()
}

// checkLost fails the test if more than one call was lost across what
// across names; one call may race a quiet close (the race every keep-alive
// server has), and is logged.
func (p *echoPosts) checkLost(t *testing.T, across string) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.failed.Load() > 1:
		t.Errorf("%d calls lost across %s: %s", p.failed.Load(), across, strings.Join(p.errs[:min(len(p.errs), 5)], "; "))
	case p.failed.Load() == 1:
		t.Logf("one call raced the quiet close: %s", p.errs[0])
	}
}

// quietCloses records the drain's "closed at a quiet moment" lines: the
// quiet each tunnel had, the quiet the rule needed and the time left.
type quietCloses struct {
	mu   sync.Mutex
	recs []quietClose
}

type quietClose struct {
	addr                string
	quiet, needed, left time.Duration
}

func (q *quietCloses) Enabled(context.Context, slog.Level) bool { return true }
func (q *quietCloses) WithAttrs([]slog.Attr) slog.Handler       { return q }
func (q *quietCloses) WithGroup(string) slog.Handler            { return q }
func (q *quietCloses) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "drain: tunnel closed at a quiet moment" {
		return nil
	}
	var c quietClose
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "addr":
			c.addr = a.Value.String()
		case "quiet":
			c.quiet = a.Value.Duration()
		case "needed":
			c.needed = a.Value.Duration()
		case "left":
			c.left = a.Value.Duration()
		}
		return true
	})
	q.mu.Lock()
	q.recs = append(q.recs, c)
	q.mu.Unlock()
	return nil
}

func (q *quietCloses) all() []quietClose {
	q.mu.Lock()
	defer q.mu.Unlock()
	return append([]quietClose(nil), q.recs...)
}

// TestQuietNeeded is the rule: a quarter of the time left, at most
// drainQuietLong, at least a poll; without a deadline, drainQuietLong.
func TestQuietNeeded(t *testing.T) {
	for _, c := range []struct{ left, want time.Duration }{
		{-1, drainQuietLong},
		{30 * time.Second, drainQuietLong},
		{2 * time.Second, drainQuietLong},
		{time.Second, 250 * time.Millisecond},
		{400 * time.Millisecond, 100 * time.Millisecond},
		{100 * time.Millisecond, 25 * time.Millisecond},
		{4 * time.Millisecond, drainPoll},
		{0, drainPoll},
	} {
		if got := quietNeeded(c.left); got != c.want {
			t.Errorf("quietNeeded(%v) = %v, want %v", c.left, got, c.want)
		}
	}
}

// TestShutdownCutsStreamingTunnelAtDeadline: a tunnel that streams (a log
// follow) is not taken for an idle keep-alive connection: it is cut at the
// deadline, or closed in a pause no shorter than the rule needs for the
// time then left (a busy machine may pause a stream that long; the rule
// promises no more), while a keep-alive tunnel idle since before the drain
// closes at once.
func TestShutdownCutsStreamingTunnelAtDeadline(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	closes := &quietCloses{}
	e := newEnv(t, func(c *Config) { c.Logger = slog.New(closes) })
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	stream := tunneltest.ServeTCP(t, func(c net.Conn) {
		chunk := bytes.Repeat([]byte("log line\n"), 100)
		for {
			if _, err := c.Write(chunk); err != nil {
				return
			}
			time.Sleep(200 * time.Microsecond)
		}
	})
	idleAddr := tunneltest.EchoServer(t)
	idle := e.EchoOne(idleAddr) // a byte there and back: the last went to the client
	defer idle.Close()
	sc, br, resp := e.Connect(stream)
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
	time.Sleep(drainQuietLong) // the keep-alive tunnel is idle since before the drain

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
			t.Errorf("idle tunnel closed %v into the drain, want at once", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("idle tunnel never closed")
	}
	var streamEnd time.Duration
	select {
	case at := <-streamEnded:
		streamEnd = at.Sub(began)
	case <-time.After(5 * time.Second):
		t.Fatal("streaming tunnel never cut")
	}
	var idleClosed, streamClosed bool
	for _, c := range closes.all() {
		if c.quiet < c.needed || c.needed != quietNeeded(c.left) {
			t.Errorf("tunnel to %s closed after %v quiet with %v left: the rule needs %v", c.addr, c.quiet, c.left, quietNeeded(c.left))
		}
		switch c.addr {
		case idleAddr:
			idleClosed = true
		case stream:
			streamClosed = true
			t.Logf("streaming tunnel closed at a quiet moment %v into a %v drain: quiet %v, needed %v", streamEnd, grace, c.quiet, c.needed)
		}
	}
	if !idleClosed {
		t.Error("the idle tunnel was not closed at a quiet moment")
	}
	if streamEnd < grace-100*time.Millisecond && !streamClosed {
		t.Errorf("streaming tunnel ended %v into a %v drain, before the deadline, and not at a quiet moment", streamEnd, grace)
	}
}

// TestAgentDrainClosesIdleTunnels: when an agent drains, the server closes
// its idle keep-alive tunnel at once, at a quiet moment, while a busy one
// through the same agent runs to its end, whole.
func TestAgentDrainClosesIdleTunnels(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	ag := e.startAgent("a1", "", func(c *agent.Config) { c.DrainTimeout = 10 * time.Second })
	e.WaitAgents(1)
	const chunks = 2000 // about a second of streaming
	chunk := bytes.Repeat([]byte("x"), 1000)
	started := make(chan struct{}, 1)
	busyDest := tunneltest.ServeTCP(t, func(c net.Conn) {
		defer c.Close()
		started <- struct{}{}
		for range chunks {
			if _, err := c.Write(chunk); err != nil {
				return
			}
			time.Sleep(500 * time.Microsecond)
		}
	})
	idle := e.EchoOne(tunneltest.EchoServer(t))
	defer idle.Close()
	idle.SetDeadline(time.Time{})
	busy, br, resp := e.Connect(busyDest)
	defer busy.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %s", resp.Status)
	}
	busy.SetDeadline(time.Time{})
	<-started
	type ended struct {
		at time.Time
		n  int64
	}
	idleEnded, busyEnded := make(chan ended, 1), make(chan ended, 1)
	go func() { n, _ := io.Copy(io.Discard, idle); idleEnded <- ended{time.Now(), n} }()
	go func() { n, _ := io.Copy(io.Discard, br); busyEnded <- ended{time.Now(), n} }()
	time.Sleep(drainQuietLong) // idle since before the drain

	began := time.Now()
	ag.Cancel() // the agent drains: it tells the server
	var idleAt, busyAt ended
	select {
	case idleAt = <-idleEnded:
	case <-time.After(10 * time.Second):
		t.Fatal("idle tunnel never closed")
	}
	select {
	case busyAt = <-busyEnded:
	case <-time.After(15 * time.Second):
		t.Fatal("busy tunnel never ended")
	}
	<-ag.Done
	t.Logf("idle tunnel closed %v into the agent's drain, busy one ended %v in with %d bytes",
		idleAt.at.Sub(began), busyAt.at.Sub(began), busyAt.n)
	if e.srv.Stats.ClosedQuiet.Load() == 0 {
		t.Error("no tunnel closed at a quiet moment, want the idle one (the busy one may follow once its answer is whole)")
	}
	if busyAt.n != chunks*int64(len(chunk)) {
		t.Errorf("busy tunnel carried %d bytes, want %d: cut", busyAt.n, chunks*len(chunk))
	}
	if !idleAt.at.Before(busyAt.at) {
		t.Error("the idle tunnel waited for the busy one: not closed at its quiet moment")
	}
}

// TestDrainWaitsForHalfClosedTunnel: a tunnel whose client finished
// sending is waiting for the rest of an answer, however long the answer
// pauses: a drain does not close it at a quiet moment (it closes an idle
// keep-alive tunnel in the same sweep), and the answer arrives whole.
func TestDrainWaitsForHalfClosedTunnel(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	more := make(chan struct{})
	dest := tunneltest.ServeTCP(t, func(c net.Conn) {
		defer c.Close()
		io.Copy(io.Discard, c) // to the client's half-close
		c.Write([]byte("a"))
		<-more // the answer pauses
		c.Write([]byte("b"))
	})
	halfClosed, br, resp := e.Connect(dest)
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
	idle := e.EchoOne(echo) // quiet since after the other tunnel's last byte
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

// TestAgentDrainClosesKeepAliveBeforeItsCut: an agent that drains says
// when it cuts what is left; a keep-alive connection in use back to back
// (never quiet for long) is closed by the server in a pause between calls
// just before that, so the agent exits without cutting a tunnel and the
// client, dialling again, reaches the other agent. A call started in the
// instant of the close is lost (the race every keep-alive server has): at
// most one is allowed, and it is logged.
func TestAgentDrainClosesKeepAliveBeforeItsCut(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	const drainTimeout = 2 * time.Second
	draining := e.startAgent("draining", "", func(c *agent.Config) { c.DrainTimeout = drainTimeout })
	e.WaitAgents(1)
	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Write(b)
	})}
	go hs.Serve(hl)
	defer hs.Close()
	url := "http://" + hl.Addr().String() + "/validate"
	tr := &http.Transport{DialContext: tunnelDialer(e.UDS, false), MaxIdleConnsPerHost: 2}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 15 * time.Second}

	posts := startEchoPosts(t, client, url, 2, func() time.Duration { return time.Duration(rand.IntN(int(5 * time.Millisecond))) })
	waitUntil := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	waitUntil("calls through the first agent", func() bool { return posts.ok.Load() >= 20 })
	other := e.startAgent("other", "", nil)
	e.WaitAgents(2)
	began := time.Now()
	draining.Cancel()
	<-draining.Done
	drained := time.Since(began)
	okBefore := posts.ok.Load()
	waitUntil("calls through the other agent", func() bool { return other.dialsOK() > 0 && posts.ok.Load() > okBefore+20 })
	posts.stop()

	t.Logf("agent drained in %v of its %v; %d tunnels closed at a quiet moment; %d calls ok, %d failed",
		drained, drainTimeout, e.srv.Stats.ClosedQuiet.Load(), posts.ok.Load(), posts.failed.Load())
	posts.checkLost(t, "the agent's drain")
	if e.srv.Stats.ClosedQuiet.Load() == 0 {
		t.Error("no tunnel was closed at a quiet moment")
	}
	if drained >= drainTimeout {
		t.Errorf("the agent drained for %v, its whole --drain-timeout: it cut the keep-alive tunnels", drained)
	}
}
