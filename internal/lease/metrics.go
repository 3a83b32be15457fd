package lease

import (
	"strconv"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/internal/promtext"
)

// Upstream's lease metric families. The histograms without explicit buckets
// upstream use the Prometheus client's defaults.
var (
	defaultBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}
	agentBuckets   = []float64{0.005, 0.025, 0.1, 0.5, 2.5, 10, 30}
)

const (
	serverPrefix = "konnectivity_network_proxy_server_"
	agentPrefix  = "konnectivity_network_proxy_agent_"
)

// serverMetrics are the Controller's series. Like upstream, only calls that
// got an answer from the apiserver are counted in the list and delete
// families (the label is the answer's status code).
type serverMetrics struct {
	m        *promtext.Registry
	culled   *promtext.Counter
	renewOK  *promtext.Counter
	renewErr *promtext.Counter
}

// RegisterServerMetrics registers the server's unlabelled lease series, so
// that they are exported (at 0) with the lease controller off too, as
// upstream's are.
func RegisterServerMetrics(m *promtext.Registry) { culledCounter(m) }

func culledCounter(m *promtext.Registry) *promtext.Counter {
	return m.Counter(serverPrefix+"culled_leases_count", "Count of expired leases that the lease garbage collection controller has culled.", nil)
}

func newServerMetrics(m *promtext.Registry) *serverMetrics {
	if m == nil {
		m = promtext.NewRegistry()
	}
	const renewals = serverPrefix + "lease_renewals_total"
	const renewalsHelp = "Attempts to create or renew this server's own Lease, by result."
	return &serverMetrics{
		m:        m,
		culled:   culledCounter(m),
		renewOK:  m.Counter(renewals, renewalsHelp, []string{"result"}, "success"),
		renewErr: m.Counter(renewals, renewalsHelp, []string{"result"}, "failure"),
	}
}

func (s *serverMetrics) observeList(err error, d time.Duration) {
	code, reason, ok := outcome(err)
	if !ok {
		return
	}
	s.m.Counter(serverPrefix+"lease_list_total", "Count of lease list calls by the garbage collection controller, by HTTP status code and reason.",
		[]string{"http_status_code", "reason"}, code, reason).Inc()
	s.m.Histogram(serverPrefix+"lease_list_latency_seconds", "Latency of lease list calls by the garbage collection controller in seconds.",
		defaultBuckets, []string{"http_status_code"}, code).ObserveDuration(d)
}

func (s *serverMetrics) observeDelete(err error, d time.Duration) {
	code, reason, ok := outcome(err)
	if !ok {
		return
	}
	s.m.Counter(serverPrefix+"lease_delete_total", "Count of lease deletion calls by the garbage collection controller, by HTTP status code and reason.",
		[]string{"http_status_code", "reason"}, code, reason).Inc()
	s.m.Histogram(serverPrefix+"lease_delete_latency_seconds", "Latency of lease deletion calls by the garbage collection controller in seconds.",
		defaultBuckets, []string{"http_status_code"}, code).ObserveDuration(d)
}

// agentMetrics are the Counter's series.
type agentMetrics struct {
	m *promtext.Registry
}

func newAgentMetrics(m *promtext.Registry) *agentMetrics {
	if m == nil {
		m = promtext.NewRegistry()
	}
	return &agentMetrics{m: m}
}

func (a *agentMetrics) observeList(err error, d time.Duration) {
	code, reason, ok := outcome(err)
	if !ok {
		return
	}
	a.m.Counter(agentPrefix+"lease_lists_total", "Count of server lease list calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason",
		[]string{"http_response_code", "reason"}, code, reason).Inc()
	a.m.Histogram(agentPrefix+"lease_list_latency_seconds", "Latency of server lease listing in seconds",
		agentBuckets, []string{"http_response_code"}, code).ObserveDuration(d)
}

func (a *agentMetrics) observeWatch(err error) {
	code, reason, ok := outcome(err)
	if !ok {
		return
	}
	a.m.Counter(agentPrefix+"lease_watches_total", "Count of server lease watch calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason",
		[]string{"http_response_code", "reason"}, code, reason).Inc()
}

// outcome is the status code and reason labels of a call: 200 and "" for
// success, the apiserver's answer for an API error; ok is false when the
// call never got an answer.
func outcome(err error) (code, reason string, ok bool) {
	if err == nil {
		return "200", "", true
	}
	c, r, ok := kubeapi.Status(err)
	if !ok {
		return "", "", false
	}
	return strconv.Itoa(c), r, true
}
