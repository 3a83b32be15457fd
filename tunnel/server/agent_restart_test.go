package server

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// restartAgentInPlace does what an agent's SIGHUP does, the exec played
// by a new Agent value with the same ID: the agent drains as a restart,
// passes the destinations it holds to the next one, which adopts them
// before it runs. want tunnels must have been paused by the server.
func restartAgentInPlace(t *testing.T, e *env, cur *testAgent, id string, want int) *testAgent {
	t.Helper()
	pausedBefore := handedOver(e.srv, "paused", resultOK)
	resumedBefore := handedOver(e.srv, "resumed", resultOK)
	cur.Restarting()
	cur.Cancel()
	select {
	case <-cur.Done:
	case <-time.After(15 * time.Second):
		t.Fatal("the restarting agent's drain did not end")
	}
	kept := cur.KeptForNextImage()
	if len(kept) != want {
		t.Fatalf("%d destinations kept for the next image, want %d", len(kept), want)
	}
	// The server counts a pause once the agent answered it and the client
	// has every byte the agent sent, which may be just after the agent's
	// drain ended.
	deadline := time.Now().Add(10 * time.Second)
	for handedOver(e.srv, "paused", resultOK)-pausedBefore != uint64(want) {
		if time.Now().After(deadline) {
			t.Fatalf("not true within 10s: the server counting %d tunnels paused (%s)", want, handoverCounts(e.srv))
		}
		time.Sleep(5 * time.Millisecond)
	}
	next := startAgentWith(t, e.PKI, []string{e.AgentAddr}, id, "", nil, func(a *agent.Agent) { a.AdoptKept(kept) })
	tunneltest.WaitUntil(t, func() bool { return handedOver(e.srv, "resumed", resultOK)-resumedBefore == uint64(want) }, "tunnels resumed on the ag's next image")
	if n := resumedOrNot(e.srv) - int(handedOver(e.srv, "resumed", resultOK)); n != 0 {
		t.Fatalf("%d tunnels not resumed", n)
	}
	return next
}

// handoverCounts is every handover metric of s and its tunnels by state,
// for a failure message.
func handoverCounts(s *Server) string {
	var b strings.Builder
	for _, w := range []string{"paused", "resumed"} {
		for _, r := range []string{resultOK, resultFailed, resultTimeout, resultNotPausable} {
			if w == "resumed" && r == resultNotPausable {
				continue
			}
			fmt.Fprintf(&b, "%s[%s]=%d ", w, r, handedOver(s, w, r))
		}
	}
	fmt.Fprintf(&b, "tunnels %v", s.Status().Tunnels)
	return b.String()
}

// echoCall is a gRPC front door call carrying a pattern both ways
// through an echo destination.
type echoCall struct {
	c          *tunneltest.GRPCCall // written by the sender goroutine and by finish once it has stopped
	id         int64                // set before the goroutines start
	sent, recv atomic.Int64         // bytes written by the sender, bytes checked by the reader
	stop, done chan struct{}        // stop ends the sender; done closes when it has returned
	readErr    chan error           // the reader's one verdict: nil once CLOSE_RSP arrives
}

// echoPace is how an echoCall's sender writes: its packet sizes come from
// a generator on stream, up to maxSize bytes, with a pause of 0 to
// maxPause-1 milliseconds after each, so that tests on different paths
// draw different but repeatable streams.
type echoPace struct {
	stream   uint64
	maxSize  int
	maxPause int
}

// startEchoCall dials dest through the gRPC front door on sock and keeps
// sending seed's pattern at pace until finish; a second goroutine checks
// every byte that comes back against the same pattern.
func startEchoCall(t *testing.T, sock, dest string, seed byte, pace echoPace) *echoCall {
	t.Helper()
	k := &echoCall{c: tunneltest.OpenGRPC(t, sock, grpcwire.ProxyMethod), stop: make(chan struct{}), done: make(chan struct{}), readErr: make(chan error, 1)}
	k.c.Write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: dest, Random: int64(seed)})
	rsp, err := k.c.Read()
	if err != nil || rsp.Type != grpcwire.DialRsp || rsp.Error != "" {
		t.Fatalf("DIAL_RSP: %+v %v", rsp, err)
	}
	k.id = rsp.ConnectID
	go func() {
		defer close(k.done)
		src := newPattern(seed)
		sizes := rand.New(rand.NewPCG(uint64(seed), pace.stream))
		for {
			select {
			case <-k.stop:
				return
			default:
			}
			b := make([]byte, 1+sizes.IntN(pace.maxSize))
			src.Read(b)
			if _, err := k.c.Send.Write(grpcwire.AppendMessage(nil, grpcwire.Packet{Type: grpcwire.Data, ConnectID: k.id, Data: b})); err != nil {
				return
			}
			k.sent.Add(int64(len(b)))
			time.Sleep(time.Duration(sizes.IntN(pace.maxPause)) * time.Millisecond)
		}
	}()
	go func() {
		want := newPattern(seed)
		for {
			p, err := k.c.Read()
			if err != nil {
				k.readErr <- fmt.Errorf("after %d bytes: %w", k.recv.Load(), err)
				return
			}
			if p.Type == grpcwire.CloseRsp {
				k.readErr <- nil
				return
			}
			exp := make([]byte, len(p.Data))
			want.Read(exp)
			if p.Type != grpcwire.Data || p.ConnectID != k.id || !bytesEqual(p.Data, exp) {
				k.readErr <- fmt.Errorf("packet %s after %d bytes differs", p.Type, k.recv.Load())
				return
			}
			k.recv.Add(int64(len(p.Data)))
		}
	}()
	return k
}

// finish stops sending, waits for every byte back, and ends the call;
// after names what the call went through, for the status error.
func (k *echoCall) finish(t *testing.T, after string) {
	t.Helper()
	close(k.stop)
	<-k.done
	tunneltest.WaitUntil(t, func() bool { return k.recv.Load() == k.sent.Load() }, "every byte back")
	k.c.Write(grpcwire.Packet{Type: grpcwire.CloseReq, ConnectID: k.id})
	if err := <-k.readErr; err != nil {
		t.Fatal(err)
	}
	if s := k.c.Status(); s != "0" {
		t.Errorf("grpc-status %q after %s", s, after)
	}
}

// TestAgentRestartKeepsTunnels: an agent that restarts in place, twice,
// hands its tunnels to its next image: HTTP CONNECT tunnels and gRPC
// calls carrying bytes both ways, and an idle keep-alive tunnel, lose,
// repeat or reorder no byte, keep their client's connection and their
// destination connection (the destination is dialled once per tunnel).
func TestAgentRestartKeepsTunnels(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	dest, accepted := countingEcho(t)
	e := newEnv(t, nil)
	ag := e.startAgent("a1", "", func(c *agent.Config) { c.DrainTimeout = 10 * time.Second })
	e.WaitAgents(1)
	sock := e.grpcSocket(t)

	var clients []*streamingClient
	for i := range 2 {
		clients = append(clients, startStreamingClient(t, e, dest, byte(i+1)))
	}
	var calls []*echoCall
	for i := range 2 {
		calls = append(calls, startEchoCall(t, sock, dest, byte(i+11), echoPace{stream: 3, maxSize: 100 << 10, maxPause: 3}))
	}
	idle := e.EchoOne(dest)
	defer idle.Close()
	const tunnels = 5

	for round := range 2 {
		tunneltest.WaitUntil(t, func() bool {
			return clients[0].recv.Load() > int64(round+1)<<20 && calls[0].recv.Load() > int64(round+1)<<19
		}, "bytes flowing")
		ag = restartAgentInPlace(t, e, ag, "a1", tunnels)
	}
	for _, c := range clients {
		before := c.recv.Load()
		tunneltest.WaitUntil(t, func() bool { return c.recv.Load() > before+64<<10 }, "bytes flowing after the restarts")
		c.finish(t)
	}
	for _, k := range calls {
		before := k.recv.Load()
		tunneltest.WaitUntil(t, func() bool { return k.recv.Load() > before+64<<10 }, "bytes flowing after the restarts")
		k.finish(t, "the ag's restarts")
	}
	echoesByte(t, idle, 'y', 10*time.Second, "idle tunnel after the restarts")
	if n := accepted.Load(); n != tunnels {
		t.Errorf("destination accepted %d connections, want %d: a tunnel was dialled again", n, tunnels)
	}
}

// stopForRestart runs the restarting half of an agent's restart in place
// and returns what it hands to the next image.
func stopForRestart(t *testing.T, a *testAgent) []*agent.KeptDest {
	t.Helper()
	a.Restarting()
	a.Cancel()
	select {
	case <-a.Done:
	case <-time.After(15 * time.Second):
		t.Fatal("the restarting agent's drain did not end")
	}
	return a.KeptForNextImage()
}

// TestAgentRestartKeptPassedOn: destinations the agent's next image
// adopted but could not hand back yet (it has not reached the server)
// pass on again at a second restart, and the image after it resumes them.
func TestAgentRestartKeptPassedOn(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	ag := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)
	var conns []net.Conn
	for range 3 {
		c := e.EchoOne(echo)
		defer c.Close()
		conns = append(conns, c)
	}
	kept := stopForRestart(t, ag)
	if len(kept) != 3 {
		t.Fatalf("%d destinations kept, want 3", len(kept))
	}
	// The next image cannot reach the server (a dead address): it holds
	// what it adopted until it restarts again.
	dead := tunneltest.ServeTCP(t, func(c net.Conn) { c.Close() })
	lost := startAgentWith(t, e.PKI, []string{dead}, "a1", "", nil, func(a *agent.Agent) { a.AdoptKept(kept) })
	kept = stopForRestart(t, lost)
	if len(kept) != 3 {
		t.Fatalf("%d destinations passed on again, want 3", len(kept))
	}
	startAgentWith(t, e.PKI, []string{e.AgentAddr}, "a1", "", nil, func(a *agent.Agent) { a.AdoptKept(kept) })
	tunneltest.WaitUntil(t, func() bool { return handedOver(e.srv, "resumed", resultOK) == 3 }, "tunnels resumed")
	for i, c := range conns {
		echoesByte(t, c, 'a'+byte(i), 10*time.Second, fmt.Sprintf("tunnel %d after two restarts", i))
	}
}

// TestAgentRestartTokenUnknown: a next image that holds nothing (what it
// was handed was lost) refuses the resumes; each tunnel is closed, logged
// and counted failed, and the server goes on.
func TestAgentRestartTokenUnknown(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	ag := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)
	c := e.EchoOne(echo)
	defer c.Close()
	kept := stopForRestart(t, ag)
	for _, h := range kept {
		h.Socket.Close()
	}
	if len(kept) != 1 {
		t.Fatalf("%d destinations kept, want 1", len(kept))
	}
	e.startAgent("a1", "", nil)
	tunneltest.WaitUntil(t, func() bool { return handedOver(e.srv, "resumed", resultFailed) == 1 }, "the resume refused")
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatalf("the client's connection is still open (read %d bytes)", n)
	}
	if c2 := e.EchoOne(echo); c2 != nil {
		c2.Close()
	}
}

// TestAgentRestartSeveralServers: an agent holding a connection to each of
// two servers restarts in place; each server pauses and resumes its own
// tunnels.
func TestAgentRestartSeveralServers(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	dest, accepted := countingEcho(t)
	p := tunneltest.NewPKI(t)
	e1 := newEnvOn(t, p, "127.0.0.1:0", nil)
	e2 := newEnvOn(t, p, "127.0.0.1:0", func(c *Config) { c.ID = "s2" })
	addrs := []string{e1.AgentAddr, e2.AgentAddr}
	ag := startAgentTo(t, p, addrs, "a1", "", nil)
	e1.WaitAgents(1)
	e2.WaitAgents(1)
	var clients []*streamingClient
	for i, e := range []*env{e1, e2, e1} {
		clients = append(clients, startStreamingClient(t, e, dest, byte(i+21)))
	}
	tunneltest.WaitUntil(t, func() bool { return clients[2].recv.Load() > 256<<10 }, "bytes flowing")
	kept := stopForRestart(t, ag)
	if len(kept) != 3 {
		t.Fatalf("%d destinations kept, want 3", len(kept))
	}
	startAgentWith(t, p, addrs, "a1", "", nil, func(a *agent.Agent) { a.AdoptKept(kept) })
	tunneltest.WaitUntil(t, func() bool {
		return handedOver(e1.srv, "resumed", resultOK) == 2 && handedOver(e2.srv, "resumed", resultOK) == 1
	}, "each server resumed its tunnels")
	for _, c := range clients {
		before := c.recv.Load()
		tunneltest.WaitUntil(t, func() bool { return c.recv.Load() > before+64<<10 }, "bytes flowing after the restart")
		c.finish(t)
	}
	if n := accepted.Load(); n != 3 {
		t.Errorf("destination accepted %d connections, want 3", n)
	}
}

// TestAgentRestartDrainsWhatCannotMove: a tunnel whose destination already
// ended its side cannot be paused; on the agent's restart it is counted not
// pausable and closed at a quiet moment, while the open tunnel beside it
// moves, and the agent's drain ends well before its timeout.
func TestAgentRestartDrainsWhatCannotMove(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	ag := e.startAgent("a1", "", func(c *agent.Config) { c.DrainTimeout = 10 * time.Second })
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)
	open := e.EchoOne(echo)
	defer open.Close()
	// A destination that answers once, ends its side, and reads until the
	// tunnel closes.
	ended := make(chan struct{})
	quiet := tunneltest.ServeTCP(t, func(c net.Conn) {
		defer close(ended)
		c.Write([]byte("x"))
		c.(*net.TCPConn).CloseWrite()
		io.Copy(io.Discard, c)
	})
	half, br, resp := e.Connect(quiet)
	defer half.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT: %s", resp.Status)
	}
	if b, err := io.ReadAll(br); err != nil || string(b) != "x" {
		t.Fatalf("the destination's answer: %q %v", b, err)
	}
	start := time.Now()
	kept := stopForRestart(t, ag)
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the ag's restart drain took %v", took)
	}
	if len(kept) != 1 {
		t.Fatalf("%d destinations kept, want 1", len(kept))
	}
	if n := handedOver(e.srv, "paused", resultNotPausable); n != 1 {
		t.Errorf("%d tunnels counted not pausable, want 1", n)
	}
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Error("the tunnel that could not move was not closed")
	}
	startAgentWith(t, e.PKI, []string{e.AgentAddr}, "a1", "", nil, func(a *agent.Agent) { a.AdoptKept(kept) })
	tunneltest.WaitUntil(t, func() bool { return handedOver(e.srv, "resumed", resultOK) == 1 }, "the open tunnel resumed")
	echoesByte(t, open, 'z', 10*time.Second, "the open tunnel after the restart")
}

// pausedForAgentRestart starts a server and agent a1 with one tunnel open
// to a counting echo destination, then stops the agent as its restart in
// place does: the tunnel is paused and its destination kept, returned
// for the agent's next image to adopt. The caller closes c.
func pausedForAgentRestart(t *testing.T) (e *env, c net.Conn, kept []*agent.KeptDest, accepted *atomic.Int64) {
	t.Helper()
	e = newEnv(t, nil)
	ag := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	dest, accepted := countingEcho(t)
	c = e.EchoOne(dest)
	kept = stopForRestart(t, ag)
	if len(kept) != 1 {
		t.Fatalf("%d destinations kept, want 1", len(kept))
	}
	return e, c, kept, accepted
}

// TestAgentRestartThenServerRestart: tunnels paused for a restarting
// agent that the server restarts before the agent is back go to the
// server's next image as they are, and resume there on the agent's next
// image.
func TestAgentRestartThenServerRestart(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e, c, kept, accepted := pausedForAgentRestart(t)
	defer c.Close()
	tunneltest.WaitUntil(t, func() bool { return e.srv.Status().Tunnels["held"] == 1 }, "the paused tunnel held for its ag")
	paused, err := handOver(e.srv)
	if err != nil || len(paused) != 1 {
		t.Fatalf("HandOver: %d paused, %v; want the one waiting for its ag", len(paused), err)
	}
	if n := e.srv.Status().Tunnels["held"]; n != 0 {
		t.Errorf("%d tunnels still held after the handover passed them on", n)
	}
	e.Stop()
	next := newEnvOn(t, e.PKI, e.AgentAddr, nil)
	next.srv.Resume(paused)
	if n := next.srv.Status().Tunnels["held"]; n != 1 {
		t.Errorf("%d tunnels held on the next image before the ag is back, want 1", n)
	}
	startAgentWith(t, e.PKI, []string{next.AgentAddr}, "a1", "", nil, func(a *agent.Agent) { a.AdoptKept(kept) })
	tunneltest.WaitUntil(t, func() bool { return resumedOrNot(next.srv) == 1 }, "the tunnel resumed")
	if handedOver(next.srv, "resumed", resultOK) != 1 {
		t.Fatal("the tunnel was not resumed on the server's next image")
	}
	if n := next.srv.Status().Tunnels["held"]; n != 0 {
		t.Errorf("%d tunnels still held once resumed", n)
	}
	echoesByte(t, c, 'z', 10*time.Second, "the tunnel after both restarts")
	if n := accepted.Load(); n != 1 {
		t.Errorf("destination accepted %d connections, want 1", n)
	}
}

// TestAgentRestartDuringResume: an agent image that restarts in place
// after it logged in but before the server resumed its tunnels refuses
// the resume and keeps the destination; the server waits for the image
// after it, and the tunnel resumes there.
func TestAgentRestartDuringResume(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e, c, kept, accepted := pausedForAgentRestart(t)
	defer c.Close()
	// The next image is already restarting when the resume reaches it.
	metrics := promtext.NewRegistry()
	next := startAgentWith(t, e.PKI, []string{e.AgentAddr}, "a1", "", func(c *agent.Config) { c.Metrics = metrics }, func(a *agent.Agent) {
		a.AdoptKept(kept)
		a.Restarting()
	})
	tunneltest.WaitUntil(t, func() bool { return tunneltest.Metric(t, metrics, agentDialReqs) == 1 }, "the resume refused")
	kept = stopForRestart(t, next)
	if len(kept) != 1 {
		t.Fatalf("%d destinations passed on, want 1", len(kept))
	}
	startAgentWith(t, e.PKI, []string{e.AgentAddr}, "a1", "", nil, func(a *agent.Agent) { a.AdoptKept(kept) })
	tunneltest.WaitUntil(t, func() bool { return resumedOrNot(e.srv) == 1 }, "the tunnel resumed")
	if handedOver(e.srv, "resumed", resultOK) != 1 {
		t.Fatal("the tunnel was not resumed on the ag's third image")
	}
	if n := handedOver(e.srv, "paused", resultOK); n != 1 {
		t.Errorf("the tunnel was paused %d times, want once: it was resumed on the restarting image", n)
	}
	echoesByte(t, c, 'z', 10*time.Second, "the tunnel after the restarts")
	if n := accepted.Load(); n != 1 {
		t.Errorf("destination accepted %d connections, want 1", n)
	}
}

// TestAgentRestartPausesLateTunnels: a tunnel that opens on an agent after
// it announced its restart in place (a resume or a dial that was under
// way) is paused for the agent's next image too, instead of draining.
func TestAgentRestartPausesLateTunnels(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	ag := e.startAgent("a1", "", func(c *agent.Config) { c.DrainTimeout = 10 * time.Second })
	e.WaitAgents(1)
	dest, accepted := countingEcho(t)
	tunneltest.WaitUntil(t, func() bool { n := ag.Status().Connected; return n == 1 }, "the agent connected")
	// A tunnel that cannot move (its client ended its upload) and that
	// its destination keeps open holds the agent's drain open, so that
	// the agent is still there, restarting, when the late tunnel comes.
	sawEnd, released := make(chan struct{}), make(chan struct{})
	release := sync.OnceFunc(func() { close(released) })
	holding := tunneltest.ServeTCP(t, func(c net.Conn) {
		io.Copy(io.Discard, c)
		close(sawEnd)
		<-released
		c.Close()
	})
	defer release() // before the listener's cleanup waits for this handler
	hc, hbr, resp := e.Connect(holding)
	defer hc.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT: %s", resp.Status)
	}
	hc.(*net.UnixConn).CloseWrite()
	<-sawEnd
	a := e.srv.agents.snapshot()[0]
	ag.Restarting()
	ag.Cancel() // Run drains: the control stream says restart-in, then drain
	tunneltest.WaitUntil(t, func() bool { return a.restarting.Load() && a.draining.Load() }, "the server told of the restart")
	c := startStreamingClient(t, e, dest, 31) // opens on the restarting agent, the only one
	tunneltest.WaitUntil(t, func() bool { return handedOver(e.srv, "paused", resultOK) == 1 }, "the late tunnel paused")
	if n := handedOver(e.srv, "paused", resultNotPausable); n != 1 {
		t.Fatalf("%d tunnels not pausable, want 1 (the one holding the drain open)", n)
	}
	release()
	if _, err := io.ReadAll(hbr); err != nil {
		t.Fatalf("the tunnel holding the drain open: %v", err)
	}
	kept := stopForRestart(t, ag)
	if len(kept) != 1 {
		t.Fatalf("%d destinations kept, want 1", len(kept))
	}
	startAgentWith(t, e.PKI, []string{e.AgentAddr}, "a1", "", nil, func(a *agent.Agent) { a.AdoptKept(kept) })
	tunneltest.WaitUntil(t, func() bool { return handedOver(e.srv, "resumed", resultOK) == 1 }, "the late tunnel resumed")
	before := c.recv.Load()
	tunneltest.WaitUntil(t, func() bool { return c.recv.Load() > before+64<<10 }, "bytes flowing after the restart")
	c.finish(t)
	if n := accepted.Load(); n != 1 {
		t.Errorf("destination accepted %d connections, want 1", n)
	}
}

// TestServerRestartDuringAgentPause: a server restart that begins while
// the server is still pausing a tunnel for its agent's restart waits for
// that pause and passes the tunnel to its next image, where the agent's
// next image resumes it.
func TestServerRestartDuringAgentPause(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	gl := gatedListen(t)
	served := make(chan struct{})
	go func() { defer close(served); e.srv.ServeAgents(gl) }()
	defer func() { gl.Close(); <-served }()
	ag := startAgentTo(t, e.PKI, []string{gl.Addr().String()}, "a1", "", nil)
	e.WaitAgents(1)
	dest, accepted := countingEcho(t)
	c := e.EchoOne(dest)
	defer c.Close()

	// The server's writes to the agent wait from here, its pause request
	// among them: the pause is under way when the handover begins.
	gl.gate()
	ag.Restarting()
	ag.Cancel()
	tunneltest.WaitUntil(t, func() bool { return e.srv.Status().Tunnels["pausing"] == 1 }, "the tunnel being paused for the ag's next image")
	var paused []*PausedTunnel
	var herr error
	handed := make(chan struct{})
	go func() { defer close(handed); paused, herr = handOver(e.srv) }()
	tunneltest.WaitUntil(t, e.srv.isShutting, "the server's handover begun")
	gl.open()
	<-handed
	if herr != nil || len(paused) != 1 {
		t.Fatalf("HandOver: %d paused, %v; want the one paused for the ag's restart", len(paused), herr)
	}
	select {
	case <-ag.Done:
	case <-time.After(15 * time.Second):
		t.Fatal("the restarting agent's drain did not end")
	}
	kept := ag.KeptForNextImage()
	if len(kept) != 1 {
		t.Fatalf("%d destinations kept, want 1", len(kept))
	}
	e.Stop()
	next := newEnvOn(t, e.PKI, e.AgentAddr, nil)
	next.srv.Resume(paused)
	startAgentWith(t, e.PKI, []string{next.AgentAddr}, "a1", "", nil, func(a *agent.Agent) { a.AdoptKept(kept) })
	tunneltest.WaitUntil(t, func() bool { return handedOver(next.srv, "resumed", resultOK) == 1 }, "the tunnel resumed on the server's next image")
	echoesByte(t, c, 'z', 10*time.Second, "the tunnel after both restarts")
	if n := accepted.Load(); n != 1 {
		t.Errorf("destination accepted %d connections, want 1", n)
	}
}

// gatedListener is a loopback listener whose connections' writes wait
// while it is gated.
type gatedListener struct {
	net.Listener
	mu   sync.Mutex    // guards shut
	shut chan struct{} // non-nil while gated; closed to open
}

func gatedListen(t *testing.T) *gatedListener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return &gatedListener{Listener: ln}
}

func (l *gatedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &gatedConn{Conn: c, l: l}, nil
}

func (l *gatedListener) gate() {
	l.mu.Lock()
	l.shut = make(chan struct{})
	l.mu.Unlock()
}

func (l *gatedListener) open() {
	l.mu.Lock()
	if l.shut != nil {
		close(l.shut)
		l.shut = nil
	}
	l.mu.Unlock()
}

type gatedConn struct {
	net.Conn
	l *gatedListener
}

func (c *gatedConn) Write(p []byte) (int, error) {
	c.l.mu.Lock()
	shut := c.l.shut
	c.l.mu.Unlock()
	if shut != nil {
		<-shut
	}
	return c.Conn.Write(p)
}

// agentDialReqs is the agent's count of the dials (and resumes) it was
// asked for.
const agentDialReqs = `konnectivity_network_proxy_agent_stream_packets_total{segment="to_agent",packet_type="DIAL_REQ"}`
