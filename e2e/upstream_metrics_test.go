package e2e

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	apiserverapi "k8s.io/apiserver/pkg/apis/apiserver"
)

// Upstream's metric families (apiserver-network-proxy pkg/server/metrics,
// pkg/agent/metrics, konnectivity-client/pkg/common/metrics) and the ones a
// default Prometheus Go client exports (client_golang's process and Go
// collectors): names, types and label names as upstream has them. The
// lease families are left to the lease-count feature.
var upstreamServerFamilies = []wantFamily{
	{srvPrefix + "dial_duration_seconds", dto.MetricType_HISTOGRAM, nil},
	{srvPrefix + "frontend_write_duration_seconds", dto.MetricType_HISTOGRAM, nil},
	{srvPrefix + "connection_duration_seconds", dto.MetricType_HISTOGRAM, nil},
	{srvPrefix + "grpc_connections", dto.MetricType_GAUGE, []string{"service_method"}},
	{srvPrefix + "http_connections", dto.MetricType_GAUGE, nil},
	{srvPrefix + "ready_backend_connections", dto.MetricType_GAUGE, nil},
	{srvPrefix + "ready_backends", dto.MetricType_GAUGE, []string{"proxy_strategy"}},
	{srvPrefix + "pending_backend_dials", dto.MetricType_GAUGE, nil},
	{srvPrefix + "established_connections", dto.MetricType_GAUGE, nil},
	{srvPrefix + "dial_failure_count", dto.MetricType_COUNTER, []string{"reason"}},
	{srvPrefix + "stream_packets_total", dto.MetricType_COUNTER, []string{"segment", "packet_type"}},
	{srvPrefix + "stream_errors_total", dto.MetricType_COUNTER, []string{"segment", "code", "packet_type"}},
}

var upstreamAgentFamilies = []wantFamily{
	{agtPrefix + "dial_duration_seconds", dto.MetricType_HISTOGRAM, nil},
	{agtPrefix + "server_connection_failure_count", dto.MetricType_COUNTER, []string{"direction"}},
	{agtPrefix + "endpoint_dial_failure_total", dto.MetricType_COUNTER, []string{"reason"}},
	{agtPrefix + "open_server_connections", dto.MetricType_GAUGE, nil},
	{agtPrefix + "known_server_count", dto.MetricType_GAUGE, nil},
	{agtPrefix + "open_endpoint_connections", dto.MetricType_GAUGE, nil},
	{agtPrefix + "stream_packets_total", dto.MetricType_COUNTER, []string{"segment", "packet_type"}},
	{agtPrefix + "stream_errors_total", dto.MetricType_COUNTER, []string{"segment", "code", "packet_type"}},
}

var defaultClientFamilies = []wantFamily{
	{"process_cpu_seconds_total", dto.MetricType_COUNTER, nil},
	{"process_resident_memory_bytes", dto.MetricType_GAUGE, nil},
	{"process_virtual_memory_bytes", dto.MetricType_GAUGE, nil},
	{"process_virtual_memory_max_bytes", dto.MetricType_GAUGE, nil},
	{"process_open_fds", dto.MetricType_GAUGE, nil},
	{"process_max_fds", dto.MetricType_GAUGE, nil},
	{"process_start_time_seconds", dto.MetricType_GAUGE, nil},
	{"process_network_receive_bytes_total", dto.MetricType_COUNTER, nil},
	{"process_network_transmit_bytes_total", dto.MetricType_COUNTER, nil},
	{"go_goroutines", dto.MetricType_GAUGE, nil},
	{"go_threads", dto.MetricType_GAUGE, nil},
	{"go_info", dto.MetricType_GAUGE, []string{"version"}},
	{"go_gc_duration_seconds", dto.MetricType_SUMMARY, nil},
	{"go_sched_gomaxprocs_threads", dto.MetricType_GAUGE, nil},
	{"go_gc_gogc_percent", dto.MetricType_GAUGE, nil},
	{"go_gc_gomemlimit_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_alloc_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_alloc_bytes_total", dto.MetricType_COUNTER, nil},
	{"go_memstats_sys_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_mallocs_total", dto.MetricType_COUNTER, nil},
	{"go_memstats_frees_total", dto.MetricType_COUNTER, nil},
	{"go_memstats_heap_alloc_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_heap_sys_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_heap_idle_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_heap_inuse_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_heap_released_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_heap_objects", dto.MetricType_GAUGE, nil},
	{"go_memstats_stack_inuse_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_stack_sys_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_mspan_inuse_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_mspan_sys_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_mcache_inuse_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_mcache_sys_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_buck_hash_sys_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_gc_sys_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_other_sys_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_next_gc_bytes", dto.MetricType_GAUGE, nil},
	{"go_memstats_last_gc_time_seconds", dto.MetricType_GAUGE, nil},
}

// Upstream's histogram buckets, so recorded dashboards keep their meaning.
var upstreamBuckets = map[string][]float64{
	srvPrefix + "dial_duration_seconds":           {0.000001, 0.00001, 0.0001, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5},
	srvPrefix + "frontend_write_duration_seconds": {0.000001, 0.00001, 0.0001, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5},
	srvPrefix + "connection_duration_seconds":     {1, 5, 15, 30, 60, 300, 900, 1800, 3600, 14400, 43200, 86400},
	agtPrefix + "dial_duration_seconds":           {0.005, 0.025, 0.1, 0.5, 2.5, 10, 30},
}

var (
	upstreamSegments    = []string{"from_agent", "from_client", "to_agent", "to_client"}
	upstreamPacketTypes = []string{"CLOSE_REQ", "CLOSE_RSP", "DATA", "DIAL_CLS", "DIAL_REQ", "DIAL_RSP", "DRAIN"}
)

func checkBuckets(t *testing.T, where string, fams metricFamilies) {
	t.Helper()
	for name, want := range upstreamBuckets {
		f := fams[name]
		if f == nil || len(f.GetMetric()) == 0 {
			continue // reported by checkFamilies
		}
		var got []float64
		for _, b := range f.GetMetric()[0].GetHistogram().GetBucket() {
			if !math.IsInf(b.GetUpperBound(), 1) { // the parser lists +Inf too
				got = append(got, b.GetUpperBound())
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s: %s buckets %v, want upstream's %v", where, name, got, want)
		}
	}
}

// sorted distinct values of label on family name.
func distinct(fams metricFamilies, name, label string) []string {
	return slices.Compact(labelValues(fams, name, label))
}

// packets is stream_packets_total{segment,packet_type}.
func packets(fams metricFamilies, prefix, segment, typ string) float64 {
	return fams.value(prefix+"stream_packets_total", "segment", segment, "packet_type", typ)
}

// TestUpstreamMetrics: every family upstream's dashboards and alerts use,
// and those of a default Prometheus client, parsed with Prometheus' text
// parser from the server and agent, with upstream's types, labels and
// buckets; then values that must move under a load of dials, on the HTTP
// CONNECT and the gRPC frontend.
func TestUpstreamMetrics(t *testing.T) {
	for _, mode := range []string{"http-connect", "grpc"} {
		t.Run(mode, func(t *testing.T) {
			s := startServer(t, "--mode="+mode)
			a := s.startAgent(t, "a1", "host=node-1")
			srv, agt := s.healthURL("/metrics"), a.healthURL("/metrics")
			proto := apiserverapi.ProtocolHTTPConnect
			if mode == "grpc" {
				proto = apiserverapi.ProtocolGRPC
			}
			d := s.egressDialerProto(t, proto)
			echo := startTCPBackend(t, "127.0.0.1", echoHandler)

			sb, ab := scrape(t, srv), scrape(t, agt)
			checkFamilies(t, "server "+srv, sb, append(slices.Clone(upstreamServerFamilies), defaultClientFamilies...))
			checkFamilies(t, "agent "+agt, ab, append(slices.Clone(upstreamAgentFamilies), defaultClientFamilies...))
			checkBuckets(t, "server", sb)
			checkBuckets(t, "agent", ab)
			for _, seg := range []struct {
				fams   metricFamilies
				prefix string
				want   []string
			}{{sb, srvPrefix, upstreamSegments}, {ab, agtPrefix, []string{"from_agent", "to_agent"}}} {
				if got := distinct(seg.fams, seg.prefix+"stream_packets_total", "segment"); !slices.Equal(got, seg.want) {
					t.Errorf("%sstream_packets_total segments %v, want %v", seg.prefix, got, seg.want)
				}
				if got := distinct(seg.fams, seg.prefix+"stream_packets_total", "packet_type"); !slices.Equal(got, upstreamPacketTypes) {
					t.Errorf("%sstream_packets_total packet types %v, want %v", seg.prefix, got, upstreamPacketTypes)
				}
				if got := distinct(seg.fams, seg.prefix+"stream_errors_total", "code"); !slices.Equal(got, []string{"Canceled", "Unavailable"}) {
					t.Errorf("%sstream_errors_total codes %v", seg.prefix, got)
				}
			}
			if got := distinct(ab, agtPrefix+"server_connection_failure_count", "direction"); !slices.Equal(got, []string{"from_server", "to_server"}) {
				t.Errorf("server_connection_failure_count directions %v", got)
			}
			if v := labelValues(sb, "go_info", "version"); len(v) != 1 || v[0] == "" {
				t.Errorf("go_info versions %v", v)
			}
			if gc := sb.series("go_gc_duration_seconds", nil); gc == nil || len(gc.GetSummary().GetQuantile()) != 5 {
				t.Errorf("go_gc_duration_seconds: %v, want a summary with 5 quantiles", gc)
			}
			for name, min := range map[string]float64{
				"process_resident_memory_bytes": 1 << 20, "process_virtual_memory_bytes": 1 << 20,
				"process_open_fds": 5, "process_max_fds": 64, "go_threads": 1, "go_memstats_sys_bytes": 1 << 20,
				"go_sched_gomaxprocs_threads": 1, "go_gc_gogc_percent": 1,
			} {
				if v := sb.value(name); v < min {
					t.Errorf("server %s = %v, want at least %v", name, v, min)
				}
			}

			// Load: dials carrying data.
			const dials = 20
			for range dials {
				echoBounded(t, d, echo.addr(), 8)
			}
			waitFor(t, 10*time.Second, "connection_duration_seconds counts the closed tunnels", func() bool {
				return metricValue(t, srv, srvPrefix+"connection_duration_seconds")-sb.value(srvPrefix+"connection_duration_seconds") >= dials
			})
			sa, aa := scrape(t, srv), scrape(t, agt)
			moved := func(where string, before, after metricFamilies, name string, atLeast float64, labels ...string) {
				t.Helper()
				if d := after.value(name, labels...) - before.value(name, labels...); d < atLeast {
					t.Errorf("%s %s%v moved by %v under %d dials, want at least %v", where, name, labels, d, dials, atLeast)
				}
			}
			for _, c := range []struct {
				seg, typ string
				min      float64
			}{
				{"from_client", "DIAL_REQ", dials}, {"to_client", "DIAL_RSP", dials},
				{"to_agent", "DIAL_REQ", dials}, {"from_agent", "DIAL_RSP", dials},
				{"from_client", "DATA", dials}, {"to_agent", "DATA", dials},
				{"from_client", "CLOSE_REQ", dials}, {"to_agent", "CLOSE_REQ", dials}, {"to_client", "CLOSE_RSP", dials},
			} {
				moved("server", sb, sa, srvPrefix+"stream_packets_total", c.min, "segment", c.seg, "packet_type", c.typ)
			}
			// Each DATA the agent sends back is counted where it is written to
			// the client: a gRPC Packet, or a write to the client's socket.
			moved("server", sb, sa, srvPrefix+"stream_packets_total", dials, "segment", "to_client", "packet_type", "DATA")
			moved("server", sb, sa, srvPrefix+"stream_packets_total", dials, "segment", "from_agent", "packet_type", "DATA")
			agentCounts := []struct{ seg, typ string }{{"to_agent", "DIAL_REQ"}, {"from_agent", "DIAL_RSP"}, {"from_agent", "DATA"}, {"to_agent", "DATA"}}
			if mode == "grpc" {
				// Upstream's own frontend: each DATA Packet's write is timed.
				moved("server", sb, sa, srvPrefix+"frontend_write_duration_seconds", 2*dials)
			} else {
				moved("server", sb, sa, srvPrefix+"frontend_write_duration_seconds", dials)
				// The client's close travels as END_STREAM, the destination's answer too.
				moved("server", sb, sa, srvPrefix+"stream_packets_total", dials, "segment", "from_agent", "packet_type", "CLOSE_RSP")
				agentCounts = append(agentCounts, struct{ seg, typ string }{"to_agent", "CLOSE_REQ"}, struct{ seg, typ string }{"from_agent", "CLOSE_RSP"})
			}
			for _, c := range agentCounts {
				moved("agent", ab, aa, agtPrefix+"stream_packets_total", dials, "segment", c.seg, "packet_type", c.typ)
			}
			moved("server", sb, sa, srvPrefix+"dial_duration_seconds", dials)
			moved("agent", ab, aa, agtPrefix+"dial_duration_seconds", dials)
			moved("server", sb, sa, "go_memstats_alloc_bytes_total", 1)
			moved("server", sb, sa, "go_memstats_mallocs_total", 1)
			moved("agent", ab, aa, "go_memstats_alloc_bytes_total", 1)
			moved("server", sb, sa, "process_network_receive_bytes_total", 1)
			// CPU time is counted in clock ticks (10 ms), and a few dials
			// may cost less than one: the counter must never go back, and
			// must move once the server has done enough work, however
			// long that takes on a busy machine.
			if cpu, before := sa.value("process_cpu_seconds_total"), sb.value("process_cpu_seconds_total"); cpu < before {
				t.Errorf("process_cpu_seconds_total went back from %v to %v", before, cpu)
			}
			const maxCPUDials = 2000
			extra := 0
			for ; metricValue(t, srv, "process_cpu_seconds_total") <= 0; extra++ {
				if extra == maxCPUDials {
					t.Fatalf("process_cpu_seconds_total = 0 after %d dials", dials+extra)
				}
				echoBounded(t, d, echo.addr(), 8)
			}
			t.Logf("server after %d dials: from_client DATA %v, to_agent DATA %v, frontend writes %v; agent from_agent DATA %v; cpu %vs (%d more dials to move it), rss %v",
				dials, packets(sa, srvPrefix, "from_client", "DATA"), packets(sa, srvPrefix, "to_agent", "DATA"),
				sa.value(srvPrefix+"frontend_write_duration_seconds"), packets(aa, agtPrefix, "from_agent", "DATA"),
				sa.value("process_cpu_seconds_total"), extra, sa.value("process_resident_memory_bytes"))

			// A server the agent cannot reach: to_server failures move.
			lost := startAgentArgs(t, "lost", "--proxy-server-host=127.0.0.1", "--proxy-server-port="+strconv.Itoa(freePort(t)),
				"--ca-cert="+s.pki.caCert, "--agent-cert="+s.pki.agentCert, "--agent-key="+s.pki.agentKey, "--sync-interval=50ms")
			waitFor(t, 10*time.Second, "server_connection_failure_count{direction=to_server} moves", func() bool {
				fams, _, err := scrapeRaw(lost.healthURL("/metrics"))
				return err == nil && fams.value(agtPrefix+"server_connection_failure_count", "direction", "to_server") >= 2
			})
		})
	}
}

// echoBounded dials addr through d and echoes n lines, all within 10 s
// (the gRPC tunnel's conn has no deadlines: a timer closes it instead).
func echoBounded(t *testing.T, d dialFunc, addr string, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := d(ctx, "tcp", addr)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	br := bufio.NewReader(conn)
	for i := range n {
		if err := echoOnce(conn, br, fmt.Sprintf("ping %d\n", i)); err != nil {
			t.Fatalf("echo %d of %d: %v", i, n, err)
		}
	}
}
