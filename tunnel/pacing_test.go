package tunnel

import (
	"context"
	"crypto/tls"
	"net"
	"testing"
	"time"
)

// A connection refused at the unadmitted limit is told when to come back,
// and the agent's dial reads it; successive refusals are handed later and
// later moments, so a fleet's retries are spread, not bunched.
func TestBusyRefusalSaysWhenToComeBack(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, func(c *ServerConfig) {
		c.MaxUnadmitted = 1
		c.HeaderTimeout = 20 * time.Second // the slot is freed by the holder leaving
	})
	holder, err := net.Dial("tcp", e.agentAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	waitUntil(t, func() bool { return e.srv.gate.open.Load() == 1 }, "the server to count the holder")

	a, err := NewAgent(AgentConfig{ServerAddrs: []string{e.agentAddr}, ID: "paced", Logger: testLogger(t),
		TLS: func(name string) (*tls.Config, error) {
			return &tls.Config{RootCAs: e.pki.pool, ServerName: name, Certificates: []tls.Certificate{e.pki.agentCert}}, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	host, _, _ := net.SplitHostPort(e.agentAddr)
	var last time.Duration
	for i := range 3 {
		_, err := a.dial(context.Background(), target{addr: e.agentAddr, serverName: host})
		r := retryAfter(err)
		if r < minRetryAfter || r > maxRetryAfter || StatusCode(err) != 503 {
			t.Fatalf("dial %d past the limit: %v (retry after %s), want a 503 that says when to come back", i, err, r)
		}
		if r <= last {
			t.Fatalf("refusal %d says come back in %s, no later than the one before (%s)", i, r, last)
		}
		last = r
	}
	holder.Close()
	waitUntil(t, func() bool { return e.srv.gate.open.Load() == 0 }, "the slot to free")
	sc, err := a.dial(context.Background(), target{addr: e.agentAddr, serverName: host})
	if err != nil {
		t.Fatalf("dial with a free slot: %v", err)
	}
	sc.conn.Close()
}

// The pacer hands out moments spaced by half the time a slot takes to
// free, within the bounds.
func TestPacerSpacesRetries(t *testing.T) {
	var p pacer
	p.admitted(64 * time.Millisecond) // 64 slots: one frees every millisecond
	now := time.Now()
	var got []time.Duration
	for range 100 {
		got = append(got, p.retryAfter(now, 64))
	}
	if got[0] != minRetryAfter {
		t.Errorf("first retry in %s, want the floor %s", got[0], minRetryAfter)
	}
	if want := 100 * 500 * time.Microsecond; got[99] != want {
		t.Errorf("100th retry in %s, want %s (0.5 ms apart)", got[99], want)
	}
	later := now.Add(time.Hour) // the burst long over: the spacing starts again from now
	if r := p.retryAfter(later, 64); r != minRetryAfter {
		t.Errorf("retry after the burst in %s, want %s", r, minRetryAfter)
	}
	for range 200000 {
		p.retryAfter(later, 1)
	}
	if r := p.retryAfter(later, 1); r != maxRetryAfter {
		t.Errorf("retry at a long backlog in %s, want the cap %s", r, maxRetryAfter)
	}
}
