//go:build !race

// The race detector's instrumented frames are larger; this file checks the
// frame budget of the real build only (make unit runs it without -race).

package tunnel

import (
	"net"
	"runtime"
	"testing"
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
	defer e.stop()

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
		conns = append(conns, e.echoOne(addr))
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
