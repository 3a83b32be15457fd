package server

import (
	"net/netip"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
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
	defer e.Stop()
	benchDials(b, e, addr)
}

// benchDials times b.N tunnels to the echo destination addr, one after
// another, each opened, echoed once and closed; the timer stops once the
// last one is closed on the server too.
func benchDials(b *testing.B, e *env, addr string) {
	dial := func() { e.EchoOne(addr).Close() }
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
	for frontOpen(e.srv) > 0 {
		if time.Now().After(deadline) {
			b.Fatalf("%d frontend connections still open", frontOpen(e.srv))
		}
		time.Sleep(time.Millisecond)
	}
}

// BenchmarkDialEchoNodeStrategy is BenchmarkDialEcho with
// --proxy-strategies=node,default and a node lookup the size of a 5,000-node
// cluster's (a map of 150,000 pod addresses under a read lock, as
// internal/nodemap's Table holds them; BenchmarkLookup there times the
// real one): the destination belongs to no node, so every dial asks the
// map and falls through to default. Compare its ns/op with
// BenchmarkDialEcho's.
//
//	go test -run '^$' -bench 'DialEcho' -count 3 ./tunnel/
func BenchmarkDialEchoNodeStrategy(b *testing.B) {
	pods := make(map[netip.Addr]string, 150000)
	for i := range 150000 {
		pods[netip.AddrFrom4([4]byte{100, byte(64 + i>>16), byte(i >> 8), byte(i)})] = "node"
	}
	var mu sync.RWMutex
	nodeOf := func(host string) (string, bool) {
		a, err := netip.ParseAddr(host)
		if err != nil {
			return "", true
		}
		mu.RLock()
		defer mu.RUnlock()
		return pods[a], true
	}
	e := newEnv(b, func(c *Config) {
		c.Strategies = []Strategy{StrategyNode, StrategyDefault}
		c.NodeOf = nodeOf
	})
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	addr := tunneltest.EchoServer(b)
	defer e.Stop()
	benchDials(b, e, addr)
	if n := e.srv.metrics.nodeRoutes[nodeFellThrough].Value(); n < uint64(b.N) {
		b.Fatalf("fallen_through = %d after %d dials: the node strategy was not asked", n, b.N)
	}
}
