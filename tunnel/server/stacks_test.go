//go:build !race

// The race detector's instrumented frames are larger; this file checks the
// frame budget of the real build only (make unit runs it without -race).

package server

import (
	"net"
	"runtime"
	"testing"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// TestIdleTunnelStacksShrink checks that the goroutine of an idle tunnel
// (the frontend connection's on the server, the stream handler's on the
// agent) parks shallow enough for a collection to shrink its stack to
// 4 KiB: the runtime halves a parked stack only while less than a quarter
// of it is used, counting an 800-byte reserve. The dial and the first
// write grow these stacks to 8 KiB; left there, they would double the
// memory of an idle tunnel. A new frame or a larger one on the parked path
// fails this test: move the work into a function that returns before the
// tunnel parks (see (*Agent).carry).
func TestIdleTunnelStacksShrink(t *testing.T) {
	e, addr := newEchoEnv(t)
	defer e.Stop()

	stacks := func() (inUse uint64, goroutines int) {
		runtime.GC()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.StackInuse, runtime.NumGoroutine()
	}
	before, g0 := stacks()
	const n = 300
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range n {
		conns = append(conns, e.EchoOne(addr))
	}
	after, g1 := stacks()
	added := g1 - g0 // per tunnel: the server's, the agent's and the echo server's
	if added < 3*n {
		t.Fatalf("%d goroutines more with %d tunnels open, want at least %d", added, n, 3*n)
	}
	per := float64(after-before) / float64(added)
	t.Logf("stack per new goroutine after two collections: %.0f bytes (%d goroutines)", per, added)
	if per > 4.5*1024 {
		t.Fatalf("idle tunnels hold %.0f bytes of stack per goroutine after two collections, want about 4 KiB: a parked stack did not shrink", per)
	}
}

// TestIdleGRPCTunnelsHoldNoBuffer checks that an idle call on the gRPC
// front door holds no copy buffer: after data in both directions (more
// than a small buffer holds, so the copies take large ones) the calls go
// quiet, and the heap they hold, everything in this process counted
// (client, server, agent, echo destination), stays far below one large
// buffer per tunnel.
func TestIdleGRPCTunnelsHoldNoBuffer(t *testing.T) {
	e, echo := newEchoEnv(t)
	defer e.Stop()
	sock := e.grpcSocket(t)
	tr := tunneltest.GRPCTransport(sock)
	mem := func() (heap, stack uint64, goroutines int) {
		runtime.GC()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapInuse, ms.StackInuse, runtime.NumGoroutine()
	}
	heap0, stack0, g0 := mem()
	const n = 100
	payload := make([]byte, 8<<10) // fills a small buffer: the copies take large ones
	for i := range n {
		c := tunneltest.OpenGRPCOn(t, tr, grpcwire.ProxyMethod)
		c.Write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: echo, Random: int64(i)})
		rsp, err := c.Read()
		if err != nil || rsp.Type != grpcwire.DialRsp || rsp.Error != "" {
			t.Fatalf("DIAL_RSP: %+v %v", rsp, err)
		}
		c.Write(grpcwire.Packet{Type: grpcwire.Data, ConnectID: rsp.ConnectID, Data: payload})
		for got := 0; got < len(payload); {
			p, err := c.Read()
			if err != nil || p.Type != grpcwire.Data {
				t.Fatalf("DATA: %v %v", p.Type, err)
			}
			got += len(p.Data)
		}
	}
	heap1, stack1, g1 := mem()
	perHeap := float64(heap1-heap0) / n
	t.Logf("per idle gRPC tunnel, the whole process: heap %.1f KiB, stack %.1f KiB in %.1f goroutines",
		perHeap/1024, float64(stack1-stack0)/n/1024, float64(g1-g0)/n)
	// The test's own client (x/net's HTTP/2 transport) keeps about 64 KiB
	// per call; one copy buffer held on top of it crosses the bound.
	if perHeap > 1.25*wire.LargeBufSize {
		t.Fatalf("idle gRPC tunnels hold %.0f KiB of heap each, the client's share and a %d KiB copy buffer or more: an idle call holds a buffer", perHeap/1024, wire.LargeBufSize>>10)
	}
}
