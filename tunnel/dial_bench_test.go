package tunnel

import (
	"runtime"
	"testing"
	"time"
)

// BenchmarkDialEcho is one tunnel's life, in process: CONNECT through the
// frontend socket, one byte there and back through the agent to an echo
// destination, close. It reports what the server and agent (and the echo
// and client, which are small) allocate per dial; allocation is what
// makes collections, and collections are part of the latency tail.
//
//	go test -run '^$' -bench DialEcho -benchmem ./tunnel/
func BenchmarkDialEcho(b *testing.B) {
	e, addr := newEchoEnv(b)
	defer e.stop()
	dial := func() { e.echoOne(addr).Close() }
	dial() // the first dial sets up pools and the HTTP/2 state
	waitTunnelsClosed(b, e)
	runtime.GC()
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		dial()
	}
	b.StopTimer()
	waitTunnelsClosed(b, e)
}

// waitTunnelsClosed waits until the server has no frontend connection open.
func waitTunnelsClosed(b *testing.B, e *env) {
	deadline := time.Now().Add(5 * time.Second)
	for e.srv.Stats.FrontendOpen.Load() > 0 {
		if time.Now().After(deadline) {
			b.Fatalf("%d frontend connections still open", e.srv.Stats.FrontendOpen.Load())
		}
		time.Sleep(time.Millisecond)
	}
}
