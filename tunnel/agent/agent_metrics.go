package agent

import (
	"sort"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/internal/promtext"
)

const agentPrefix = "konnectivity_network_proxy_agent_"

type agentMetrics struct {
	dialDuration *promtext.Histogram
	dialTimeout  *promtext.Counter
	dialUnknown  *promtext.Counter
	dialDenied   *promtext.Counter
	resets       *promtext.Counter
	panics       *promtext.Counter
	// streamsRefused counts CONNECT streams refused at MaxStreams or
	// MaxStreamsTotal.
	streamsRefused *promtext.Counter
	// serverFailures counts upstream's deprecated server_connection_failure_count:
	// to_server, a connection to a server that could not be made; from_server,
	// one that broke (a read error other than the server's clean close).
	toServerFailures, fromServerFailures *promtext.Counter
	packets                              wire.PacketCounts
	streamErrs                           wire.StreamErrors
	creditStalls                         wire.CreditStalls // the server links' (serveConn)
}

func newAgentMetrics(m *promtext.Registry, a *Agent) *agentMetrics {
	const failures = agentPrefix + "endpoint_dial_failure_total"
	const failuresHelp = "Destination dials that failed, by reason."
	am := &agentMetrics{
		dialDuration: m.Histogram(agentPrefix+"dial_duration_seconds", "Time to dial a destination, for successful dials.", agentDialBuckets, nil),
		dialTimeout:  m.Counter(failures, failuresHelp, []string{"reason"}, "timeout"),
		dialUnknown:  m.Counter(failures, failuresHelp, []string{"reason"}, "unknown"),
		dialDenied:   m.Counter(failures, failuresHelp, []string{"reason"}, "denied"),
		resets:       m.Counter(agentPrefix+"stream_resets_total", "Tunnels that ended with an abort (RST_STREAM) instead of a clean close.", nil),
		panics:       m.Counter(agentPrefix+"panics_total", "Panics recovered in per-tunnel goroutines (each ended one tunnel).", nil),
	}
	am.streamsRefused = m.Counter(agentPrefix+"streams_refused_total", "Tunnels refused (503) because the agent carried its most at once, from one server (--max-streams) or from all (--max-streams-total).", nil)
	const serverFailures = agentPrefix + "server_connection_failure_count"
	const serverFailuresHelp = "Count of failures to send to or receive from the proxy server, labeled by the direction (from_server or to_server): a connection that could not be made, or one that broke. DEPRECATED upstream, please use stream_errors_total."
	am.toServerFailures = m.Counter(serverFailures, serverFailuresHelp, []string{"direction"}, "to_server")
	am.fromServerFailures = m.Counter(serverFailures, serverFailuresHelp, []string{"direction"}, "from_server")
	am.packets.Register(m, agentPrefix+"stream_packets_total", wire.SegFromAgent, wire.SegToAgent)
	am.streamErrs.Register(m, agentPrefix+"stream_errors_total", wire.SegFromAgent, wire.SegToAgent)
	am.creditStalls.Register(m, agentPrefix+"credit_stalls_total")
	// A scrape checks the links for credit stalls, beside their keepalive
	// timers, so the family is current when read.
	m.OnScrape(func() {
		for _, lk := range a.links() {
			lk.CheckCredit(0)
		}
	})
	m.GaugeFunc(agentPrefix+"open_server_connections", "Servers this agent holds a tunnel connection to.", nil, nil,
		func() float64 { n, _ := a.connected(); return float64(n) })
	m.GaugeFunc(agentPrefix+"known_server_count", "Servers this agent wants a tunnel to (the largest count a live server announced, or the count of server Leases).", nil, nil,
		func() float64 { _, want := a.connected(); return float64(want) })
	m.GaugeFunc(agentPrefix+"open_endpoint_connections", "Open tunnels: destination connections open or being dialled.", nil, nil,
		func() float64 { return float64(a.Stats.Tunnels.Load()) })
	m.CounterFunc(agentPrefix+"bytes_total", "Bytes carried to and from destinations, by direction.", []string{"direction"}, []string{"to_endpoint"},
		func() float64 { return float64(a.Stats.BytesToDest.Load()) })
	m.CounterFunc(agentPrefix+"bytes_total", "", []string{"direction"}, []string{"from_endpoint"},
		func() float64 { return float64(a.Stats.BytesFromDest.Load()) })
	return am
}

// agentDialBuckets are the buckets of upstream's agent
// dial_duration_seconds, so that recorded dashboards keep their meaning.
var agentDialBuckets = []float64{0.005, 0.025, 0.1, 0.5, 2.5, 10, 30}

// Status is what /debug/tunnels shows for an agent.
type Status struct {
	Role        string             `json:"role"` // "agent"
	AgentID     string             `json:"agentID"`
	Connected   int                `json:"held"` // servers connected to; "held" is the name tools read
	Want        int                `json:"want"`
	LeaseCount  int                `json:"leaseCount,omitempty"` // valid server Leases, when counted
	OpenStreams int64              `json:"openStreams"`
	Servers     []ServerConnStatus `json:"servers"`
}

// ServerConnStatus is one server connection, as the agent sees it.
type ServerConnStatus struct {
	ServerID    string    `json:"serverID"`
	Addr        string    `json:"addr"`
	Since       time.Time `json:"since"`
	Count       int       `json:"serverCount"`
	OpenStreams int64     `json:"openStreams"`
	// CreditStalls counts the credit stalls seen on the connection's link;
	// SendWaiting is how many of its tunnels wait for send credit now
	// toward the server, and SendWaits the longest waits
	// (wire.MaxSendWaits). docs/slow-links.md says what they tell.
	CreditStalls uint64          `json:"creditStalls"`
	SendWaiting  int             `json:"sendWaiting"`
	SendWaits    []wire.SendWait `json:"sendWaits,omitempty"`
}

// Status reports the agent's server connections, sorted by server ID.
func (a *Agent) Status() Status {
	a.mu.Lock()
	st := Status{Role: "agent", AgentID: a.cfg.ID, Connected: len(a.conns), Want: a.maxCount, LeaseCount: a.leaseCount, Servers: []ServerConnStatus{}}
	links := make([]*h2link.Conn, 0, len(a.conns))
	for l := range a.conns {
		st.Servers = append(st.Servers, ServerConnStatus{ServerID: l.id, Addr: l.addr, Since: l.since, Count: l.count, OpenStreams: l.tunnels.Load()})
		links = append(links, l.link.Load())
	}
	a.mu.Unlock()
	// The links are checked outside Agent.mu: their checks may tell of a
	// stall, which logs.
	now := time.Now()
	for i, lk := range links {
		if lk == nil {
			continue
		}
		cs := lk.CheckCredit(wire.MaxSendWaits)
		st.Servers[i].CreditStalls, st.Servers[i].SendWaiting, st.Servers[i].SendWaits = cs.Stalls, cs.Waiting, wire.SendWaits(cs, now)
	}
	st.OpenStreams = a.Stats.Tunnels.Load()
	sort.Slice(st.Servers, func(i, j int) bool { return st.Servers[i].ServerID < st.Servers[j].ServerID })
	return st
}
