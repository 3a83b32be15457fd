package tunnel

import (
	"fmt"
	"io"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

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
	cur.cancel()
	select {
	case <-cur.done:
	case <-time.After(15 * time.Second):
		t.Fatal("the restarting agent's drain did not end")
	}
	held := cur.HeldForNextImage()
	if len(held) != want {
		t.Fatalf("%d destinations held for the next image, want %d", len(held), want)
	}
	if n := handedOver(e.srv, "paused", resultOK) - pausedBefore; n != uint64(want) {
		t.Fatalf("server paused %d tunnels, want %d", n, want)
	}
	next := startAgentWith(t, e.pki, []string{e.agentAddr}, id, "", nil, func(a *Agent) { a.AdoptHeld(held) })
	waitUntil(t, func() bool { return handedOver(e.srv, "resumed", resultOK)-resumedBefore == uint64(want) }, "tunnels resumed on the agent's next image")
	if n := resumedOrNot(e.srv) - int(handedOver(e.srv, "resumed", resultOK)); n != 0 {
		t.Fatalf("%d tunnels not resumed", n)
	}
	return next
}

// echoCall is a gRPC front door call carrying a pattern both ways
// through an echo destination.
type echoCall struct {
	c          *grpcCall
	id         int64
	sent, recv atomic.Int64
	stop, done chan struct{}
	readErr    chan error
}

func startEchoCall(t *testing.T, sock, dest string, seed byte) *echoCall {
	t.Helper()
	k := &echoCall{c: openGRPC(t, sock, grpcProxyMethod), stop: make(chan struct{}), done: make(chan struct{}), readErr: make(chan error, 1)}
	k.c.write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: dest, Random: int64(seed)})
	rsp, err := k.c.read()
	if err != nil || rsp.Type != grpcwire.DialRsp || rsp.Error != "" {
		t.Fatalf("DIAL_RSP: %+v %v", rsp, err)
	}
	k.id = rsp.ConnectID
	go func() {
		defer close(k.done)
		src := newPattern(seed)
		sizes := rand.New(rand.NewPCG(uint64(seed), 3))
		for {
			select {
			case <-k.stop:
				return
			default:
			}
			b := make([]byte, 1+sizes.IntN(100<<10))
			src.Read(b)
			if _, err := k.c.send.Write(grpcwire.AppendMessage(nil, grpcwire.Packet{Type: grpcwire.Data, ConnectID: k.id, Data: b})); err != nil {
				return
			}
			k.sent.Add(int64(len(b)))
			time.Sleep(time.Duration(sizes.IntN(3)) * time.Millisecond)
		}
	}()
	go func() {
		want := newPattern(seed)
		for {
			p, err := k.c.read()
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

// finish stops sending, waits for every byte back, and ends the call.
func (k *echoCall) finish(t *testing.T) {
	t.Helper()
	close(k.stop)
	<-k.done
	waitUntil(t, func() bool { return k.recv.Load() == k.sent.Load() }, "every byte back")
	k.c.write(grpcwire.Packet{Type: grpcwire.CloseReq, ConnectID: k.id})
	if err := <-k.readErr; err != nil {
		t.Fatal(err)
	}
	if s := k.c.status(); s != "0" {
		t.Errorf("grpc-status %q after the agent's restarts", s)
	}
}

// TestAgentRestartKeepsTunnels: an agent that restarts in place, twice,
// hands its tunnels to its next image: HTTP CONNECT tunnels and gRPC
// calls carrying bytes both ways, and an idle keep-alive tunnel, lose,
// repeat or reorder no byte, keep their client's connection and their
// destination connection (the destination is dialled once per tunnel).
func TestAgentRestartKeepsTunnels(t *testing.T) {
	checkNoLeaks(t)
	dest, accepted := countingEcho(t)
	e := newEnv(t, nil)
	agent := e.startAgent("a1", "", func(c *AgentConfig) { c.DrainTimeout = 10 * time.Second })
	e.waitAgents(1)
	sock := e.grpcSocket(t)

	var clients []*streamingClient
	for i := range 2 {
		clients = append(clients, startStreamingClient(t, e, dest, byte(i+1)))
	}
	var calls []*echoCall
	for i := range 2 {
		calls = append(calls, startEchoCall(t, sock, dest, byte(i+11)))
	}
	idle := e.echoOne(dest)
	defer idle.Close()
	const tunnels = 5

	for round := range 2 {
		waitUntil(t, func() bool { return clients[0].recv.Load() > int64(round+1)<<20 && calls[0].recv.Load() > int64(round+1)<<19 }, "bytes flowing")
		agent = restartAgentInPlace(t, e, agent, "a1", tunnels)
	}
	for _, c := range clients {
		before := c.recv.Load()
		waitUntil(t, func() bool { return c.recv.Load() > before+64<<10 }, "bytes flowing after the restarts")
		c.finish(t)
	}
	for _, k := range calls {
		before := k.recv.Load()
		waitUntil(t, func() bool { return k.recv.Load() > before+64<<10 }, "bytes flowing after the restarts")
		k.finish(t)
	}
	if _, err := idle.Write([]byte("y")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	idle.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(idle, b); err != nil || b[0] != 'y' {
		t.Fatalf("idle tunnel after the restarts: %q %v", b, err)
	}
	if n := accepted.Load(); n != tunnels {
		t.Errorf("destination accepted %d connections, want %d: a tunnel was dialled again", n, tunnels)
	}
}
