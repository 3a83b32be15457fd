package server

import (
	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/wire"
)

// Server metrics use upstream's names and labels where the concept exists,
// so existing dashboards keep working.
const serverPrefix = "konnectivity_network_proxy_server_"

type serverMetrics struct {
	dialDuration  *promtext.Histogram
	frontendWrite *promtext.Histogram
	connDuration  *promtext.Histogram
	established   *promtext.Gauge
	httpConns     *promtext.Gauge
	grpcConns     *promtext.Gauge
	pending       *promtext.Gauge
	resets        *promtext.Counter
	panics        *promtext.Counter
	failures      map[string]*promtext.Counter
	nodeRoutes    map[string]*promtext.Counter // by result; only with the node strategy on
	packets       wire.PacketCounts
	streamErrs    wire.StreamErrors
	creditStalls  wire.CreditStalls // the agent links' (startAgentLink)
	// Agent logins and connections refused by the bounds per credential
	// and on the agents' descriptors.
	agentsRefusedCred *promtext.Counter
	agentsRefusedFD   *promtext.Counter
}

func newServerMetrics(m *promtext.Registry, s *Server) *serverMetrics {
	sm := &serverMetrics{
		dialDuration:      m.Histogram(serverPrefix+"dial_duration_seconds", "Time from a frontend dial request to the agent's answer, for successful dials.", latencyBuckets, nil),
		frontendWrite:     m.Histogram(serverPrefix+"frontend_write_duration_seconds", "Time of one write to the frontend: the dial's answer, and each DATA packet on the gRPC frontend.", latencyBuckets, nil),
		connDuration:      m.Histogram(serverPrefix+"connection_duration_seconds", "How long established tunnels stayed open.", connectionBuckets, nil),
		established:       m.Gauge(serverPrefix+"established_connections", "Open tunnels (dials the agent answered).", nil),
		httpConns:         m.Gauge(serverPrefix+"http_connections", "Open HTTP CONNECT frontend connections.", nil),
		grpcConns:         m.Gauge(serverPrefix+"grpc_connections", "Open gRPC frontend streams, by method.", []string{"service_method"}, "Proxy"),
		pending:           m.Gauge(serverPrefix+"pending_backend_dials", "Dials waiting for an agent's answer.", nil),
		resets:            m.Counter(serverPrefix+"stream_resets_total", "Tunnels that ended with an abort (RST_STREAM) instead of a clean close.", nil),
		panics:            m.Counter(serverPrefix+"panics_total", "Panics recovered in per-connection goroutines (each ended one connection).", nil),
		agentsRefusedCred: m.Counter(serverPrefix+"agent_connection_limit_refusals_total", "Agent logins and connections refused by a bound, by limit: per_credential (--max-agent-connections-per-credential from one address) or descriptors (the agents hold the descriptors they may).", []string{"limit"}, "per_credential"),
		agentsRefusedFD:   m.Counter(serverPrefix+"agent_connection_limit_refusals_total", "Agent logins and connections refused by a bound, by limit: per_credential (--max-agent-connections-per-credential from one address) or descriptors (the agents hold the descriptors they may).", []string{"limit"}, "descriptors"),
		failures:          map[string]*promtext.Counter{},
	}
	m.GaugeFunc(serverPrefix+"stalled_tunnel_bytes", "Bytes the agents sent that wait in the server for clients that do not read them yet; past --stalled-tunnel-memory-budget new dials are refused (dial_failure_count{reason=\"stalled_budget\"}).", nil, nil,
		func() float64 { return float64(s.queued.Load()) })
	for _, r := range []string{reasonNoAgent, reasonErrorResponse, reasonDialTimeout, reasonFrontendClosed, reasonBadRequest, reasonForbidden, reasonBackendClosed, reasonShutdown, reasonNoFD, reasonStalledBudget} {
		sm.failures[r] = m.Counter(serverPrefix+"dial_failure_count", "Dials that failed, by reason.", []string{"reason"}, r)
	}
	if s.nodeRank >= 0 {
		sm.nodeRoutes = map[string]*promtext.Counter{}
		for _, r := range []string{nodeRouted, nodeFellThrough, nodeRefused} {
			sm.nodeRoutes[r] = m.Counter(serverPrefix+"node_route_total", "Dials the node proxy strategy saw, by result: routed to the agent bound to the node that owns the destination, fallen through to a later strategy, or refused (503) for want of any agent.", []string{"result"}, r)
		}
	}
	m.Gauge(serverPrefix+"grpc_connections", "", []string{"service_method"}, "Connect") // agents speak HTTP/2 CONNECT, not gRPC
	sm.packets.Register(m, serverPrefix+"stream_packets_total", wire.SegFromClient, wire.SegToClient, wire.SegFromAgent, wire.SegToAgent)
	sm.streamErrs.Register(m, serverPrefix+"stream_errors_total", wire.SegFromClient, wire.SegToClient, wire.SegFromAgent, wire.SegToAgent)
	m.GaugeFunc(serverPrefix+"ready_backend_connections", "Connected agents (deprecated upstream; see ready_backends).", nil, nil,
		func() float64 { return float64(s.agents.len()) })
	for _, st := range s.cfg.Strategies {
		m.GaugeFunc(serverPrefix+"ready_backends", "Agents a dial could be routed to, by proxy strategy.", []string{"proxy_strategy"}, []string{string(st)},
			func() float64 { return float64(s.agents.countFor(st, int64(s.cfg.MaxStreamsPerAgent))) })
	}
	m.CounterFunc(serverPrefix+"bytes_total", "Bytes carried through tunnels, by direction.", []string{"direction"}, []string{"to_agent"},
		func() float64 { return float64(s.Stats.BytesToAgent.Load()) })
	m.CounterFunc(serverPrefix+"bytes_total", "", []string{"direction"}, []string{"from_agent"},
		func() float64 { return float64(s.Stats.BytesFromAgent.Load()) })
	for _, st := range shownStates {
		m.GaugeFunc(serverPrefix+"tunnels", "Tunnels in the server's table, by state (dialing tunnels are counted by pending_backend_dials).", []string{"state"}, []string{st.String()},
			func() float64 { return float64(s.countTunnels(st)) })
	}
	sm.creditStalls.Register(m, serverPrefix+"credit_stalls_total")
	// A scrape checks the links for credit stalls, beside their keepalive
	// timers, so the family is current when read.
	m.OnScrape(func() {
		for _, a := range s.agents.snapshot() {
			if l := a.ourLink(); l != nil {
				l.CheckCredit(0)
			}
		}
	})
	m.CounterFunc(serverPrefix+"agents_refused_total", "Agent connections refused (TLS, handshake or authentication).", nil, nil,
		func() float64 { return float64(s.Stats.AgentsRefused.Load()) })
	return sm
}

func (sm *serverMetrics) dialFailed(err error) {
	if c := sm.failures[failureReason(err)]; c != nil {
		c.Inc()
	}
}

// countEnd counts a tunnel's clean end from the agent's side: its
// END_STREAM is upstream's CLOSE_RSP from the agent, passed on to the
// client.
func (sm *serverMetrics) countEnd() {
	sm.packets.Inc(wire.SegFromAgent, grpcwire.CloseRsp)
	sm.packets.Inc(wire.SegToClient, grpcwire.CloseRsp)
}

// Buckets of the upstream metrics of the same names, so that recorded
// dashboards keep their meaning: the server's latencies (dial_duration_seconds,
// frontend_write_duration_seconds) and connection_duration_seconds.
var (
	latencyBuckets    = []float64{0.000001, 0.00001, 0.0001, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5}
	connectionBuckets = []float64{1, 5, 15, 30, 60, 300, 900, 1800, 3600, 14400, 43200, 86400}
)
