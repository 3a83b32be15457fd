package agent

import (
	"net/http"
	"testing"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// TestAgentStreamCaps: the default bounds come from the descriptor limit,
// two descriptors per tunnel beside reservedDescriptors, and one server
// connection may use all of it.
func TestAgentStreamCaps(t *testing.T) {
	for _, c := range []struct {
		limit          uint64
		perConn, total uint32
	}{
		{1024, 384, 384},
		{20000, 9872, 9872},
		{100, 16, 16},
		{1 << 20, (1<<20 - 256) / 2, (1<<20 - 256) / 2},
	} {
		perConn, total := streamCaps(c.limit)
		if perConn != c.perConn || total != c.total {
			t.Errorf("streamCaps(%d) = %d per connection, %d in total; want %d, %d", c.limit, perConn, total, c.perConn, c.total)
		}
	}
}

// TestAgentMaxStreamsTotal: past MaxStreamsTotal (and so past MaxStreams,
// derived from it here) the agent answers a
// CONNECT 503 (the server tells its client), counts it, and serves again
// once a tunnel ends.
func TestAgentMaxStreamsTotal(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	dest := tunneltest.EchoServer(t)
	e := newEnv(t, nil)
	a := e.startAgent("a1", "", func(c *Config) { c.MaxStreamsTotal = 2 })
	e.WaitAgents(1)
	c1 := e.EchoOne(dest)
	c2 := e.EchoOne(dest)
	if code, _, err := e.DialStatus(dest); err != nil || code == http.StatusOK {
		t.Fatalf("third tunnel past MaxStreamsTotal=2: %d %v, want a refusal", code, err)
	}
	if n := a.metrics.streamsRefused.Value(); n < 1 {
		t.Errorf("streams_refused_total %d, want at least 1", n)
	}
	c1.Close()
	c2.Close()
	tunneltest.WaitUntil(t, func() bool { return a.Stats.Tunnels.Load() == 0 }, "tunnels ended on the agent")
	e.EchoOne(dest).Close()
}
