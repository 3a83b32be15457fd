package tunnel

import (
	"strings"
	"testing"
	"time"
)

func TestMetricsTextFormat(t *testing.T) {
	m := NewMetrics()
	m.Counter("x_total", "A counter\nwith a newline and \\.", []string{"reason"}, "a \"quoted\"\\path\n").Add(3)
	m.Gauge("y", "A gauge.", nil).Set(-2)
	h := m.Histogram("z_seconds", "A histogram.", []float64{0.1, 1}, []string{"k"}, "v")
	h.ObserveDuration(50 * time.Millisecond)
	h.ObserveDuration(500 * time.Millisecond)
	h.ObserveDuration(5 * time.Second)
	var b strings.Builder
	if err := m.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	want := `# HELP x_total A counter\nwith a newline and \\.
# TYPE x_total counter
x_total{reason="a \"quoted\"\\path\n"} 3
# HELP y A gauge.
# TYPE y gauge
y -2
# HELP z_seconds A histogram.
# TYPE z_seconds histogram
z_seconds_bucket{k="v",le="0.1"} 1
z_seconds_bucket{k="v",le="1"} 2
z_seconds_bucket{k="v",le="+Inf"} 3
z_seconds_sum{k="v"} 5.55
z_seconds_count{k="v"} 3
`
	if b.String() != want {
		t.Fatalf("got:\n%s\nwant:\n%s", b.String(), want)
	}
}

func TestServerMetricsMoveWithDials(t *testing.T) {
	checkNoLeaks(t)
	m := NewMetrics()
	e := newEnv(t, func(c *ServerConfig) { c.Metrics = m; c.AgentWait = 100 * time.Millisecond })
	conn, _, resp := e.connect("127.0.0.1:80")
	conn.Close()
	if resp.StatusCode != 503 {
		t.Fatal(resp.Status)
	}
	e.startAgent("a1", "", nil)
	e.waitAgents(1)
	conn, _, resp = e.connect(echoServer(t))
	conn.Close()
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	var b strings.Builder
	m.WriteText(&b)
	for _, want := range []string{
		`konnectivity_network_proxy_server_dial_failure_count{reason="no_agent"} 1`,
		"konnectivity_network_proxy_server_dial_duration_seconds_count 1\n",
		"konnectivity_network_proxy_server_ready_backend_connections 1\n",
		`konnectivity_network_proxy_server_ready_backends{proxy_strategy="default"} 1`,
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

func TestLogLimiter(t *testing.T) {
	l := newLogLimiter(time.Hour)
	if ok, _ := l.allow("k"); !ok {
		t.Fatal("first line suppressed")
	}
	for range 5 {
		if ok, _ := l.allow("k"); ok {
			t.Fatal("repeat within the interval allowed")
		}
	}
	if ok, _ := l.allow("other"); !ok {
		t.Fatal("another key suppressed")
	}
	l.keys["k"].last = time.Now().Add(-2 * time.Hour)
	if ok, n := l.allow("k"); !ok || n != 5 {
		t.Fatalf("after the interval: allowed %v, suppressed %d, want true 5", ok, n)
	}
}
