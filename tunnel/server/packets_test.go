package server

import (
	"strings"
	"sync/atomic"
	"testing"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// Packet and error counts are exposed with upstream's label names and
// values, and an increment shows in the next scrape.
func TestPacketCountsExposition(t *testing.T) {
	m := promtext.NewRegistry()
	var p wire.PacketCounts
	var e wire.StreamErrors
	p.Register(m, "x_stream_packets_total", wire.SegFromAgent, wire.SegToAgent)
	e.Register(m, "x_stream_errors_total", wire.SegFromAgent)
	p.Inc(wire.SegFromAgent, grpcwire.Data)
	p.Inc(wire.SegFromAgent, grpcwire.Data)
	p.Inc(wire.SegToAgent, grpcwire.DialReq)
	e.Inc(wire.SegFromAgent, wire.CodeUnavailable, grpcwire.Data)
	pw := &wire.PacketWriter{W: &strings.Builder{}, C: wire.PacketCounter{&p.N[wire.SegToAgent][grpcwire.Data], nil}}
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
	var p wire.PacketCounts
	c := wire.PacketCounter{&p.N[wire.SegFromClient][grpcwire.Data], &p.N[wire.SegToAgent][grpcwire.Data]}
	if n := testing.AllocsPerRun(100, func() { c.Inc(); p.Inc(wire.SegToClient, grpcwire.CloseRsp) }); n != 0 {
		t.Errorf("%v allocations per count", n)
	}
}

// TestSinkWritesCountAsDATA: the bytes the link writes straight to a
// socket (the server's to the client in HTTP CONNECT mode, the agent's to
// its destination) count as DATA Packets like every other write.
func TestSinkWritesCountAsDATA(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	metrics := promtext.NewRegistry()
	e.startAgent("a1", "", func(c *agent.Config) { c.Metrics = metrics })
	e.WaitAgents(1)
	c := e.EchoOne(tunneltest.EchoServer(t))
	c.Close()
	// Each count is made as its write returns, which may be just after the
	// echo reached the client: wait for it rather than read it at once.
	srv := &e.srv.metrics.packets.N
	for _, n := range []struct {
		name string
		v    *atomic.Uint64
	}{
		{"server to_client DATA", &srv[wire.SegToClient][grpcwire.Data]},
		{"server from_agent DATA", &srv[wire.SegFromAgent][grpcwire.Data]},
	} {
		tunneltest.WaitUntil(t, func() bool { return n.v.Load() > 0 }, n.name+" counted")
	}
	tunneltest.WaitUntil(t, func() bool {
		return tunneltest.Metric(t, metrics, `konnectivity_network_proxy_agent_stream_packets_total{segment="to_agent",packet_type="DATA"}`) > 0
	}, "agent to_agent DATA counted")
}
