package server

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"

	"golang.org/x/net/http2"
)

// An agent that reads every frame and never returns connection credit
// holds a tunnel's upload in its link's send queue, with stream credit to
// spare: after the bound the server counts a credit stall
// (credit_stalls_total{kind="connection_credit"}), logs it once with its
// figures, and /debug/tunnels shows it in the agent's row with the tunnel
// that waits, its destination and what it waits for.
func TestCreditStallShown(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const bound = 200 * time.Millisecond
	m := promtext.NewRegistry()
	var log lockedBuf
	e := newEnv(t, func(c *Config) {
		c.Metrics = m
		c.CreditStallAfter = bound
		c.Logger = slog.New(slog.NewTextHandler(&log, nil))
	})
	defer e.Stop()
	ev := dialEvil(t, e, "evil", "", []http2.Setting{{ID: http2.SettingInitialWindowSize, Val: 1 << 30}}, func(ev *evilAgent, f *http2.MetaHeadersFrame) {
		if !isControl(f) {
			answer200(ev, f)
		}
	})
	defer ev.conn.Close()
	e.WaitAgents(1)
	const dest = "10.0.0.1:80"
	conn, _, resp := e.Connect(dest)
	defer conn.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	// More than the link's first 65,535 bytes of connection credit, less
	// than the client's socket buffer: the write returns.
	if _, err := conn.Write(make([]byte, 128<<10)); err != nil {
		t.Fatal(err)
	}
	var row AgentStatus
	tunneltest.WaitUntil(t, func() bool {
		row = e.srv.Status().Agents[0]
		return row.CreditStalls > 0
	}, "the agent's row counts a credit stall")
	t.Logf("agent row: %+v", row)
	if row.ID != "evil" || row.CreditStalls != 1 || row.SendWaiting != 1 || len(row.SendWaits) != 1 {
		t.Fatalf("agent row %+v: want evil with one stall and one tunnel waiting", row)
	}
	if w := row.SendWaits[0]; w.For != "connection" || w.Destination != dest || w.Seconds < bound.Seconds() || w.Stream == 0 {
		t.Errorf("waiting tunnel %+v: want one to %s waiting for the connection's credit for %v or more", w, dest, bound)
	}
	if v := tunneltest.Metric(t, m, `konnectivity_network_proxy_server_credit_stalls_total{kind="connection_credit"}`); v != 1 {
		t.Errorf("credit_stalls_total{kind=connection_credit} %v, want 1", v)
	}
	if v := tunneltest.Metric(t, m, `konnectivity_network_proxy_server_credit_stalls_total{kind="credit_owed"}`); v != 0 {
		t.Errorf("credit_stalls_total{kind=credit_owed} %v, want 0", v)
	}
	// Checked again past the bound (every status read and scrape checks),
	// the same stall is neither counted nor logged again.
	for end := time.Now().Add(3 * bound); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		e.srv.Status()
		tunneltest.Metric(t, m, "konnectivity_network_proxy_server_credit_stalls_total")
	}
	if n := e.srv.Status().Agents[0].CreditStalls; n != 1 {
		t.Errorf("%d stalls counted after more checks, want 1", n)
	}
	lines := strings.Count(log.String(), "credit stall")
	line := log.String()[max(0, strings.Index(log.String(), "credit stall")):]
	line, _, _ = strings.Cut(line, "\n")
	t.Logf("log: %s", line)
	if lines != 1 || !strings.Contains(line, "agent=evil") || !strings.Contains(line, "kind=connection_credit") ||
		!strings.Contains(line, "conn_send_window=0") || !strings.Contains(line, "writers_waiting=1") {
		t.Errorf("%d credit stall lines, want one naming the agent, the kind and the windows:\n%s", lines, log.String())
	}
}
