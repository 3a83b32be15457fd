package tunnel

import (
	"strings"
	"sync/atomic"
	"testing"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// Packet and error counts are exposed with upstream's label names and
// values, and an increment shows in the next scrape.
func TestPacketCountsExposition(t *testing.T) {
	m := promtext.NewRegistry()
	var p packetCounts
	var e streamErrors
	p.register(m, "x_stream_packets_total", segFromAgent, segToAgent)
	e.register(m, "x_stream_errors_total", segFromAgent)
	p.inc(segFromAgent, grpcwire.Data)
	p.inc(segFromAgent, grpcwire.Data)
	p.inc(segToAgent, grpcwire.DialReq)
	e.inc(segFromAgent, codeUnavailable, grpcwire.Data)
	pw := &packetWriter{w: &strings.Builder{}, c: packetCounter{&p.n[segToAgent][grpcwire.Data], nil}}
	pw.Write([]byte("abc"))
	var b strings.Builder
	m.WriteText(&b)
	out := b.String()
	for _, want := range []string{
		"# TYPE x_stream_packets_total counter\n",
		`x_stream_packets_total{segment="from_agent",packet_type="DATA"} 2` + "\n",
		`x_stream_packets_total{segment="to_agent",packet_type="DIAL_REQ"} 1` + "\n",
		`x_stream_packets_total{segment="to_agent",packet_type="DATA"} 1` + "\n",
		`x_stream_packets_total{segment="to_agent",packet_type="DRAIN"} 0` + "\n",
		`x_stream_errors_total{segment="from_agent",code="Unavailable",packet_type="DATA"} 1` + "\n",
		`x_stream_errors_total{segment="from_agent",code="Canceled",packet_type="DIAL_REQ"} 0` + "\n",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("exposition lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, `segment="from_client"`) {
		t.Errorf("segments not registered are exposed:\n%s", out)
	}
}

// Counting a packet allocates nothing.
func TestPacketCountingAllocs(t *testing.T) {
	var p packetCounts
	c := packetCounter{&p.n[segFromClient][grpcwire.Data], &p.n[segToAgent][grpcwire.Data]}
	if n := testing.AllocsPerRun(100, func() { c.inc(); p.inc(segToClient, grpcwire.CloseRsp) }); n != 0 {
		t.Errorf("%v allocations per count", n)
	}
}

// TestSinkWritesCountAsDATA: the bytes the link writes straight to a
// socket (the server's to the client in HTTP CONNECT mode, the agent's to
// its destination) count as DATA Packets like every other write.
func TestSinkWritesCountAsDATA(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, nil)
	a := e.startAgent("a1", "", nil)
	e.waitAgents(1)
	c := e.echoOne(echoServer(t))
	c.Close()
	// Each count is made as its write returns, which may be just after the
	// echo reached the client: wait for it rather than read it at once.
	srv := &e.srv.metrics.packets.n
	for _, n := range []struct {
		name string
		v    *atomic.Uint64
	}{
		{"server to_client DATA", &srv[segToClient][grpcwire.Data]},
		{"server from_agent DATA", &srv[segFromAgent][grpcwire.Data]},
		{"agent to_agent DATA", &a.metrics.packets.n[segToAgent][grpcwire.Data]},
	} {
		waitUntil(t, func() bool { return n.v.Load() > 0 }, n.name+" counted")
	}
}
