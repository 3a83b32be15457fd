package server

import (
	"strings"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/internal/promtext"
)

func TestServerMetricsMoveWithDials(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	m := promtext.NewRegistry()
	e := newEnv(t, func(c *Config) { c.Metrics = m; c.AgentWait = 100 * time.Millisecond })
	conn, _, resp := e.Connect("127.0.0.1:80")
	conn.Close()
	if resp.StatusCode != 503 {
		t.Fatal(resp.Status)
	}
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	conn, _, resp = e.Connect(tunneltest.EchoServer(t))
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
	l := wire.NewLogLimiter(time.Hour)
	if ok, _ := l.Allow("k"); !ok {
		t.Fatal("first line suppressed")
	}
	for range 5 {
		if ok, _ := l.Allow("k"); ok {
			t.Fatal("repeat within the interval allowed")
		}
	}
	if ok, _ := l.Allow("other"); !ok {
		t.Fatal("another key suppressed")
	}
	l.Keys["k"].Last = time.Now().Add(-2 * time.Hour)
	if ok, n := l.Allow("k"); !ok || n != 5 {
		t.Fatalf("after the interval: allowed %v, suppressed %d, want true 5", ok, n)
	}
}
