package server

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// patternStream is a deterministic byte stream: a writer and a reader with
// the same seed agree on every byte, so a reader can tell a lost,
// repeated or reordered byte at its offset.
type patternStream struct{ r *rand.ChaCha8 }

func newPattern(seed byte) *patternStream {
	var s [32]byte
	s[0] = seed
	return &patternStream{rand.NewChaCha8(s)}
}

func (p *patternStream) Read(b []byte) (int, error) { return p.r.Read(b) }

// streamingClient writes a pattern into a tunnel to an echo destination
// in chunks of varied size while it reads the echo back and checks every
// byte, until stop; then it half-closes and reads to the end.
type streamingClient struct {
	conn       net.Conn
	br         *bufio.Reader
	sent, recv atomic.Int64
	err        chan error // the reader's verdict
	stop       chan struct{}
	writerDone chan error
}

func startStreamingClient(t *testing.T, e *env, dest string, seed byte) *streamingClient {
	t.Helper()
	conn, br, resp := e.Connect(dest)
	if resp.StatusCode != http.StatusOK {
		conn.Close()
		t.Fatalf("CONNECT: %s", resp.Status)
	}
	conn.SetDeadline(time.Now().Add(60 * time.Second))
	c := &streamingClient{conn: conn, br: br, err: make(chan error, 1), stop: make(chan struct{}), writerDone: make(chan error, 1)}
	go func() {
		src := newPattern(seed)
		sizes := rand.New(rand.NewPCG(uint64(seed), 1))
		buf := make([]byte, 64<<10)
		for {
			select {
			case <-c.stop:
				c.writerDone <- conn.(*net.UnixConn).CloseWrite()
				return
			default:
			}
			n := 1 + sizes.IntN(len(buf))
			src.Read(buf[:n])
			if _, err := conn.Write(buf[:n]); err != nil {
				c.writerDone <- err
				return
			}
			c.sent.Add(int64(n))
			time.Sleep(time.Duration(sizes.IntN(3)) * time.Millisecond)
		}
	}()
	go func() {
		want := newPattern(seed)
		got := make([]byte, 32<<10)
		exp := make([]byte, 32<<10)
		for {
			n, err := br.Read(got)
			if n > 0 {
				want.Read(exp[:n])
				for i := range n {
					if got[i] != exp[i] {
						c.err <- fmt.Errorf("byte %d differs", c.recv.Load()+int64(i))
						return
					}
				}
				c.recv.Add(int64(n))
			}
			if err == io.EOF {
				c.err <- nil
				return
			}
			if err != nil {
				c.err <- fmt.Errorf("read after %d bytes: %w", c.recv.Load(), err)
				return
			}
		}
	}()
	return c
}

// finish stops writing and waits for every byte to come back.
func (c *streamingClient) finish(t *testing.T) {
	t.Helper()
	close(c.stop)
	if err := <-c.writerDone; err != nil {
		t.Errorf("writer: %v", err)
	}
	if err := <-c.err; err != nil {
		t.Errorf("reader: %v", err)
	}
	if c.recv.Load() != c.sent.Load() {
		t.Errorf("sent %d bytes, %d came back", c.sent.Load(), c.recv.Load())
	}
	c.conn.Close()
}

// countingEcho is an echo destination that counts its connections.
func countingEcho(t *testing.T) (addr string, accepted *atomic.Int64) {
	accepted = new(atomic.Int64)
	addr = tunneltest.ServeTCP(t, func(c net.Conn) {
		accepted.Add(1)
		io.Copy(c, c)
		c.(*net.TCPConn).CloseWrite()
	})
	return addr, accepted
}

// handOverTo hands cur's tunnels, of which want must be paused, to a new
// server on the same agent port (what a self-restart does), stops cur and
// returns the new server once it resumed them all.
func handOverTo(t *testing.T, cur *env, want int) (*env, []*PausedTunnel) {
	t.Helper()
	paused, err := handOver(cur.srv)
	if err != nil {
		t.Fatalf("HandOver: %v", err)
	}
	failed := handedOver(cur.srv, "paused", resultFailed) + handedOver(cur.srv, "paused", resultTimeout)
	if len(paused) != want || failed != 0 {
		t.Fatalf("%d tunnels paused, %d failed; want %d, 0", len(paused), failed, want)
	}
	checkHandoverMetric(t, cur.srv, "paused", resultOK, want)
	cur.Stop()
	next := newEnvOn(t, cur.PKI, cur.AgentAddr, nil)
	next.srv.Resume(paused)
	tunneltest.WaitUntil(t, func() bool { return resumedOrNot(next.srv) == want }, "tunnels resumed")
	if n := resumedOrNot(next.srv) - int(handedOver(next.srv, "resumed", resultOK)); n != 0 {
		t.Fatalf("%d tunnels not resumed", n)
	}
	checkHandoverMetric(t, next.srv, "resumed", resultOK, want)
	return next, paused
}

// handedOver is a handover metric's count: of tunnels "paused" or
// "resumed", with result.
func handedOver(s *Server, which, result string) uint64 {
	m := s.hand.metrics.paused
	if which == "resumed" {
		m = s.hand.metrics.resumed
	}
	return m[result].Value()
}

// resumedOrNot counts the tunnels s resumed or failed to.
func resumedOrNot(s *Server) int {
	n := uint64(0)
	for _, r := range []string{resultOK, resultFailed, resultTimeout} {
		n += handedOver(s, "resumed", r)
	}
	return int(n)
}

// checkHandoverMetric checks that s's metrics, as a scrape shows them,
// count want tunnels "paused" or "resumed" with result.
func checkHandoverMetric(t *testing.T, s *Server, which, result string, want int) {
	t.Helper()
	var b strings.Builder
	if err := s.cfg.Metrics.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	line := fmt.Sprintf("%stunnels_%s_total{result=%q} %d\n", serverPrefix, which, result, want)
	if !strings.Contains(b.String(), line) {
		t.Errorf("metrics lack %q", line)
	}
	if st := s.Status(); st.Restarts == nil || restartCount(st.Restarts, which, result) != uint64(want) {
		t.Errorf("status shows %+v, want %d tunnels %s %s", st.Restarts, want, which, result)
	}
}

// TestHandOverResumesTunnels: tunnels carrying bytes both ways through a
// handover to a new server (as a self-restart does) and a second one lose,
// repeat or reorder no byte, keep their destination connection, and the
// new server resumes each one.
func TestHandOverResumesTunnels(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	dest, accepted := countingEcho(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)

	const tunnels = 4
	var clients []*streamingClient
	for i := range tunnels {
		clients = append(clients, startStreamingClient(t, e, dest, byte(i+1)))
	}
	idle := e.EchoOne(dest) // a keep-alive connection between calls
	defer idle.Close()

	cur := e
	for round := range 2 {
		tunneltest.WaitUntil(t, func() bool { return clients[0].recv.Load() > int64(round+1)<<20 }, "bytes flowing")
		cur, _ = handOverTo(t, cur, tunnels+1)
	}
	for _, c := range clients {
		before := c.recv.Load()
		tunneltest.WaitUntil(t, func() bool { return c.recv.Load() > before+64<<10 }, "bytes flowing after the handovers")
		c.finish(t)
	}
	// The idle keep-alive tunnel still answers.
	echoesByte(t, idle, 'y', 10*time.Second, "idle tunnel after the handovers")
	if n := accepted.Load(); n != tunnels+1 {
		t.Errorf("destination accepted %d connections, want %d: a tunnel was dialled again", n, tunnels+1)
	}
}

// TestHandOverLeavesSharedGRPCConn: two calls on one gRPC front door
// connection are not paused (a connection is frozen whole, and holds one
// call when konnectivity-client made it): they are counted not pausable
// and drain as with Shutdown, closed at a quiet moment with CLOSE_RSP.
func TestHandOverLeavesSharedGRPCConn(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	dest, _ := countingEcho(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	tr := tunneltest.GRPCTransport(e.grpcSocket(t))
	var calls []*tunneltest.GRPCCall
	for i := range 2 {
		c := tunneltest.OpenGRPCOn(t, tr, grpcwire.ProxyMethod)
		c.Write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: dest, Random: int64(i + 1)})
		rsp, err := c.Read()
		if err != nil || rsp.Type != grpcwire.DialRsp || rsp.Error != "" {
			t.Fatalf("DIAL_RSP: %+v %v", rsp, err)
		}
		c.Write(grpcwire.Packet{Type: grpcwire.Data, ConnectID: rsp.ConnectID, Data: []byte("x")})
		if p, err := c.Read(); err != nil || p.Type != grpcwire.Data || string(p.Data) != "x" {
			t.Fatalf("echo: %+v %v", p, err)
		}
		calls = append(calls, c)
	}
	paused, err := handOver(e.srv)
	if err != nil || len(paused) != 0 {
		t.Fatalf("HandOver: %d paused, %v; want none and the drain to end", len(paused), err)
	}
	if n := handedOver(e.srv, "paused", resultNotPausable); n != 2 {
		t.Errorf("%d calls counted not pausable, want 2", n)
	}
	for _, c := range calls {
		if p, err := c.Read(); err != nil || p.Type != grpcwire.CloseRsp {
			t.Errorf("a drained call: %+v %v, want CLOSE_RSP", p, err)
		}
	}
}

// TestHandOverResumesGRPCCalls: gRPC front door calls (one HTTP/2
// connection each, as konnectivity-client makes them) carrying DATA
// packets both ways through two handovers lose, repeat or reorder no byte,
// keep their destination connection and their connection to the server,
// and end with CLOSE_RSP and status 0 as usual. Packets of up to 200 KiB
// span several HTTP/2 frames, so some pauses fall inside a message.
func TestHandOverResumesGRPCCalls(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	dest, accepted := countingEcho(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	sock := e.grpcSocket(t)

	const calls = 3
	var cs []*echoCall
	for i := range calls {
		// Uploads small enough that the test's client (x/net's Transport,
		// whose reader waits for its writer) does not fill its socket while
		// the server has stopped reading: such a client cannot be paused
		// (docs/restart.md, "The handover: open tunnels move to the new image").
		cs = append(cs, startEchoCall(t, sock, dest, byte(i+1), echoPace{stream: 2, maxSize: 16 << 10, maxPause: 5}))
	}

	cur := e
	for round := range 2 {
		tunneltest.WaitUntil(t, func() bool { return cs[0].recv.Load() > int64(round+1)<<20 }, "bytes flowing")
		var paused []*PausedTunnel
		cur, paused = handOverTo(t, cur, calls)
		partial := 0
		for _, p := range paused {
			if p.GRPC == nil {
				t.Fatalf("round %d: a call paused without its gRPC state", round)
			}
			if len(p.GRPC.Partial) > 0 {
				partial++
			}
		}
		t.Logf("round %d: %d calls paused, %d in the middle of a message", round, len(paused), partial)
	}
	for _, k := range cs {
		before := k.recv.Load()
		tunneltest.WaitUntil(t, func() bool { return k.recv.Load() > before+64<<10 }, "bytes flowing after the handovers")
		k.finish(t, "the handovers")
	}
	if n := accepted.Load(); n != calls {
		t.Errorf("destination accepted %d connections, want %d", n, calls)
	}
}

// handOver runs srv's handover as a SIGHUP does, bounded so that a
// handover that never ends fails the test instead of hanging it.
func handOver(srv *Server) ([]*PausedTunnel, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return srv.HandOver(ctx)
}

func bytesEqual(a, b []byte) bool { return string(a) == string(b) }

// echoesByte writes x on c, through an echo destination, and fails the
// test unless x comes back within wait; what names the tunnel and the
// moment for the failure.
func echoesByte(t *testing.T, c net.Conn, x byte, wait time.Duration, what string) {
	t.Helper()
	if _, err := c.Write([]byte{x}); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	c.SetReadDeadline(time.Now().Add(wait))
	if _, err := io.ReadFull(c, b); err != nil || b[0] != x {
		t.Fatalf("%s: %q %v", what, b, err)
	}
}

// TestPauseRequestsRefused: the agent answers a pause request it cannot
// honour with a clear status and leaves the tunnel as it was: malformed
// (400), a stream that is no tunnel (404); and a resume with an unknown
// token opens nothing.
func TestPauseRequestsRefused(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e, echo := newEchoEnv(t)
	defer e.Stop()
	c := e.EchoOne(echo) // an open tunnel, stream 3 or later on the link
	defer c.Close()
	a := e.srv.agents.snapshot()[0]
	ask := func(h http.Header) int {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		req := (&http.Request{Method: http.MethodPost, URL: &url.URL{Scheme: "https", Host: "agent", Path: wire.PausePath}, Host: "agent", Header: h}).WithContext(ctx)
		resp, err := a.ourLink().RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, tc := range []struct {
		name string
		h    http.Header
		want int
	}{
		{"no headers", http.Header{}, http.StatusBadRequest},
		{"bad stream", http.Header{wire.HdrPauseStream: {"x"}, wire.HdrPauseSent: {"0"}, wire.HdrResumeToken: {"tok"}}, http.StatusBadRequest},
		{"negative count", http.Header{wire.HdrPauseStream: {"3"}, wire.HdrPauseSent: {"-1"}, wire.HdrResumeToken: {"tok"}}, http.StatusBadRequest},
		{"token with a space", http.Header{wire.HdrPauseStream: {"3"}, wire.HdrPauseSent: {"0"}, wire.HdrResumeToken: {"a b"}}, http.StatusBadRequest},
		{"no such tunnel", http.Header{wire.HdrPauseStream: {"99999"}, wire.HdrPauseSent: {"0"}, wire.HdrResumeToken: {"tok"}}, http.StatusNotFound},
	} {
		if got := ask(tc.h); got != tc.want {
			t.Errorf("%s: status %d, want %d", tc.name, got, tc.want)
		}
	}
	// A resume with a token nobody holds opens no tunnel.
	pr, pw := io.Pipe() // a client that sends nothing and stays
	rt := &tunnel{s: e.srv, addr: echo}
	rt.up.init(bufio.NewReader(pr), func() { pw.Close() }, &rt.act, e.srv.goroutine)
	if err := e.srv.roundTrip(rt, a, time.Now().Add(5*time.Second), "0123456789abcdef"); err == nil || !strings.Contains(err.Error(), "no paused tunnel for this resume token") {
		t.Errorf("resume with an unknown token: %v, want the ag's refusal", err)
	}
	rt.up.unblock()
	// The tunnel still works.
	echoesByte(t, c, 'z', 5*time.Second, "tunnel after the refused pauses")
}

// TestHandOverWhileAgentStops: an agent told to stop (SIGTERM) while a
// restarting server pauses its tunnels keeps them as open tunnels: it
// waits, within its drain timeout, for the next image to resume them,
// and they finish intact before it exits.
func TestHandOverWhileAgentStops(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	dest, _ := countingEcho(t)
	e := newEnv(t, nil)
	ag := e.startAgent("a1", "", func(c *agent.Config) { c.DrainTimeout = 10 * time.Second })
	e.WaitAgents(1)
	c := startStreamingClient(t, e, dest, 7)
	tunneltest.WaitUntil(t, func() bool { return c.recv.Load() > 1<<20 }, "bytes flowing")

	paused, err := handOver(e.srv)
	if err != nil || len(paused) != 1 {
		t.Fatalf("HandOver: %d paused, %v", len(paused), err)
	}
	ag.Cancel() // the agent's stop arrives before the next image
	e.Stop()
	next := newEnvOn(t, e.PKI, e.AgentAddr, nil)
	next.srv.Resume(paused)
	tunneltest.WaitUntil(t, func() bool { return resumedOrNot(next.srv) == 1 }, "tunnel resumed")
	if handedOver(next.srv, "resumed", resultOK) != 1 {
		t.Fatalf("the stopping ag's tunnel was not resumed")
	}
	before := c.recv.Load()
	tunneltest.WaitUntil(t, func() bool { return c.recv.Load() > before+64<<10 }, "bytes flowing after the handover")
	c.finish(t)
	select {
	case <-ag.Done:
	case <-time.After(10 * time.Second):
		t.Fatal("the ag did not stop once its last tunnel ended")
	}
}

// TestCloseDropsHeldTunnels: a server closed while a tunnel the previous
// image handed over still waits for its agent (held) closes the client's
// connection and counts the resume as failed; nothing is left in the
// table.
func TestCloseDropsHeldTunnels(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	dest, _ := countingEcho(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	c := e.EchoOne(dest)
	defer c.Close()
	paused, err := handOver(e.srv)
	if err != nil || len(paused) != 1 {
		t.Fatalf("HandOver: %d paused, %v", len(paused), err)
	}
	e.Stop()
	next := newEnvOn(t, e.PKI, e.AgentAddr, nil) // no agent logs in to it
	next.srv.Resume(paused)
	if n := next.srv.Status().Tunnels["held"]; n != 1 {
		t.Fatalf("%d tunnels held, want the one waiting for its ag", n)
	}
	next.Stop()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("client's read once the server closed: %v, want EOF", err)
	}
	if n := handedOver(next.srv, "resumed", resultFailed); n != 1 {
		t.Errorf("%d resumes counted failed, want 1", n)
	}
	if n := next.srv.countTunnels(tunnelHeld); n != 0 || len(next.srv.tunnels) != 0 {
		t.Errorf("after Close: %d held, %d in the table; want none", n, len(next.srv.tunnels))
	}
}

// TestHandOverWhileResuming: a restart that comes once the agent is back
// but before the tunnels the previous one paused have resumed pauses them
// again (a shutdown waits for resumes under way, as for accepted dials)
// instead of leaving them to the drain, which closes a keep-alive
// connection: each tunnel keeps its one destination connection.
func TestHandOverWhileResuming(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	dest, accepted := countingEcho(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	const tunnels = 8
	var idle []net.Conn
	for range tunnels {
		c := e.EchoOne(dest)
		defer c.Close()
		idle = append(idle, c)
	}
	paused, err := handOver(e.srv)
	if err != nil || len(paused) != tunnels {
		t.Fatalf("HandOver: %d paused, %v; want %d", len(paused), err, tunnels)
	}
	e.Stop()
	next := newEnvOn(t, e.PKI, e.AgentAddr, nil)
	next.WaitAgents(1)
	next.srv.Resume(paused)
	last, _ := handOverTo(t, next, tunnels) // at once: the resumes are under way
	defer last.Stop()
	b := make([]byte, 1)
	for i, c := range idle {
		if _, err := c.Write([]byte{'a' + byte(i)}); err != nil {
			t.Fatalf("tunnel %d after the handovers: %v", i, err)
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(c, b); err != nil || b[0] != 'a'+byte(i) {
			t.Fatalf("tunnel %d after the handovers: %q %v", i, b, err)
		}
	}
	if n := accepted.Load(); n != tunnels {
		t.Errorf("destination accepted %d connections, want %d: a tunnel was dialled again", n, tunnels)
	}
}

// TestHandOverPassesDialWaitingForAgent: a dial still waiting for an agent
// when a handover begins (its agent is reconnecting) goes to the next
// image with what its client sent, head and early bytes, instead of
// holding the handover until its grace ends and being cut; the next
// image, whose agent is back, dials it.
func TestHandOverPassesDialWaitingForAgent(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	dest, accepted := countingEcho(t)
	e := newEnv(t, func(c *Config) { c.AgentWait = time.Minute })
	conn, err := net.DialTimeout("unix", e.UDS, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	const early = "sent before the answer"
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n%s", dest, early)
	tunneltest.WaitUntil(t, func() bool { return e.srv.pending.Load() == 1 }, "the dial waiting for an ag")

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	paused, err := e.srv.HandOver(ctx)
	if err != nil {
		t.Fatalf("HandOver: %v", err)
	}
	if len(paused) != 1 || !paused[0].Unasked {
		t.Fatalf("handed over %d connections (%+v), want the waiting dial's", len(paused), paused)
	}
	if h := string(paused[0].Head); !strings.HasPrefix(h, "CONNECT "+dest) || !strings.HasSuffix(h, early) {
		t.Fatalf("handed over with %q, want its head and the bytes after it", h)
	}
	e.Stop()

	next := newEnvOn(t, e.PKI, e.AgentAddr, nil)
	next.startAgent("a1", "", nil)
	next.WaitAgents(1)
	next.srv.Resume(paused)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT answer from the next image: %v %v", resp, err)
	}
	got := make([]byte, len(early))
	if _, err := io.ReadFull(br, got); err != nil || string(got) != early {
		t.Fatalf("echo of the early bytes: %q %v", got, err)
	}
	if n := accepted.Load(); n != 1 {
		t.Errorf("destination accepted %d connections, want 1", n)
	}
}

// restartCount is what a status shows of the tunnels paused or resumed
// with result.
func restartCount(h *RestartStatus, which, result string) uint64 {
	if which == "resumed" {
		return h.Resumed[result]
	}
	return h.Paused[result]
}
