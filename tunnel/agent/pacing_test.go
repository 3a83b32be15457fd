package agent

import (
	"context"
	"crypto/tls"
	"net"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/server"
	"github.com/spinifex/konnectivity/tunnel/wire"
)

// A connection refused at the unadmitted limit is told when to come back,
// and the agent's dial reads it; successive refusals are given later and
// later moments, so a fleet's retries are spread, not bunched.
func TestBusyRefusalSaysWhenToComeBack(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *server.Config) {
		c.MaxUnadmitted = 1
		c.HeaderTimeout = 20 * time.Second // the slot is freed by the holder leaving
	})
	// The holder's TLS handshake completes only once the server accepted
	// it, and so counts it against the limit.
	host, _, _ := net.SplitHostPort(e.AgentAddr)
	holderTLS, _ := e.PKI.AgentTLS(host)
	holder, err := tls.Dial("tcp", e.AgentAddr, holderTLS)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	a, err := New(Config{ServerAddrs: []string{e.AgentAddr}, ID: "paced", Logger: tunneltest.Logger(t), TLS: e.PKI.AgentTLS})
	if err != nil {
		t.Fatal(err)
	}
	dest := target{addr: e.AgentAddr, serverName: host}
	var last time.Duration
	for i := range 3 {
		_, err := a.dial(context.Background(), dest)
		r := retryAfter(err)
		if r < wire.MinRetryAfter || r > wire.MaxRetryAfter || wire.StatusCode(err) != 503 {
			t.Fatalf("dial %d past the limit: %v (retry after %s), want a 503 that says when to come back", i, err, r)
		}
		if r <= last {
			t.Fatalf("refusal %d says come back in %s, no later than the one before (%s)", i, r, last)
		}
		last = r
	}
	holder.Close()
	tunneltest.WaitUntil(t, func() bool {
		sc, err := a.dial(context.Background(), dest)
		if err == nil {
			sc.conn.Close()
		}
		return err == nil
	}, "a dial admitted once the slot frees")
}
