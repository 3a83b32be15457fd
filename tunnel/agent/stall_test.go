package agent

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// syncBuf is a log destination several goroutines write.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// A server that reads every frame and never returns connection credit
// holds the agent's download (a destination that writes) in the link's
// send queue, with stream credit to spare: after the bound the agent
// counts a credit stall (credit_stalls_total{kind="connection_credit"}),
// logs it once with its figures, and /debug/tunnels shows it in the
// server's row with the tunnel that waits.
func TestCreditStallShownOnAgent(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const bound = 200 * time.Millisecond
	p := tunneltest.NewPKI(t)
	dest := tunneltest.ServeTCP(t, func(c net.Conn) { c.Write(make([]byte, 1<<20)) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	// The server: the handshake, SETTINGS with stream credit to spare, one
	// CONNECT to dest; then it reads everything and answers PINGs, with
	// no credit ever.
	served := make(chan error, 1)
	go func() {
		raw, err := ln.Accept()
		if err != nil {
			served <- err
			return
		}
		defer raw.Close()
		c := tls.Server(raw, &tls.Config{Certificates: []tls.Certificate{p.ServerCert}})
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			served <- err
			return
		}
		c.Write(wire.Switching("s1", 1))
		c.Write([]byte(http2.ClientPreface))
		fr := http2.NewFramer(c, br)
		fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30})
		var hb bytes.Buffer
		enc := hpack.NewEncoder(&hb)
		enc.WriteField(hpack.HeaderField{Name: ":method", Value: http.MethodConnect})
		enc.WriteField(hpack.HeaderField{Name: ":authority", Value: dest})
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				served <- nil
				return
			}
			if f, ok := f.(*http2.PingFrame); ok && !f.IsAck() {
				fr.WritePing(true, f.Data)
			}
		}
	}()
	m := promtext.NewRegistry()
	var log syncBuf
	a := startAgentTo(t, p, []string{ln.Addr().String()}, "a1", "", func(c *Config) {
		c.Metrics = m
		c.CreditStallAfter = bound
		c.Logger = slog.New(slog.NewTextHandler(&log, nil))
	})
	var row ServerConnStatus
	tunneltest.WaitUntil(t, func() bool {
		st := a.Status()
		if len(st.Servers) == 0 {
			return false
		}
		row = st.Servers[0]
		return row.CreditStalls > 0
	}, "the server's row counts a credit stall")
	t.Logf("server row: %+v", row)
	if row.CreditStalls != 1 || row.SendWaiting != 1 || len(row.SendWaits) != 1 {
		t.Fatalf("server row %+v: want one stall and one tunnel waiting", row)
	}
	if w := row.SendWaits[0]; w.For != "connection" || w.Stream != 1 || w.Seconds < bound.Seconds() {
		t.Errorf("waiting tunnel %+v: want stream 1 waiting for the connection's credit for %v or more", w, bound)
	}
	if v := tunneltest.Metric(t, m, `konnectivity_network_proxy_agent_credit_stalls_total{kind="connection_credit"}`); v != 1 {
		t.Errorf("credit_stalls_total{kind=connection_credit} %v, want 1", v)
	}
	for end := time.Now().Add(3 * bound); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		a.Status()
		tunneltest.Metric(t, m, "konnectivity_network_proxy_agent_credit_stalls_total")
	}
	text := log.String()
	if n := strings.Count(text, "credit stall"); n != 1 || !strings.Contains(text, "server_id=s1") || !strings.Contains(text, "kind=connection_credit") || !strings.Contains(text, "stream=1 ") {
		t.Errorf("%d credit stall lines, want one naming the server, the kind and the stream:\n%s", n, text)
	}
	a.Stop()
	ln.Close()
	if err := <-served; err != nil {
		t.Fatal(err)
	}
}
