package server

import (
	"strings"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// One credential from one address holds at most MaxAgentsPerCredential
// agent connections, whatever IDs it logs in with; a login past it is
// refused 429 naming the bound, and gets in once one of them left. A login
// that replaces its own ID's connection takes no more room.
func TestAgentsPerCredentialBound(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	var log lockedBuf
	e := newEnv(t, func(c *Config) {
		c.MaxAgentsPerCredential = 2
		c.Logger = logTo(&log)
	})
	a1 := e.startAgent("a1", "", nil)
	e.startAgent("a2", "", nil)
	e.WaitAgents(2)
	e.startAgent("a3", "", nil)
	tunneltest.WaitUntil(t, func() bool { return e.srv.metrics.agentsRefusedCred.Value() >= 2 }, "the third login refused (twice)")
	if n := e.srv.AgentCount(); n != 2 {
		t.Fatalf("%d agents with one credential, bound 2", n)
	}
	if !strings.Contains(log.String(), "max-agent-connections-per-credential") {
		t.Errorf("the refusal does not name the bound:\n%s", log.String())
	}
	a1.Stop()
	tunneltest.WaitUntil(t, func() bool { return findAgent(e, "a3") != nil }, "a3 gets in once a1 left")
	e.WaitAgents(2)
	// The same ID again with the same credential replaces its connection.
	e.startAgent("a2", "", nil)
	time.Sleep(300 * time.Millisecond)
	if n := e.srv.AgentCount(); n != 2 {
		t.Fatalf("%d agents after a2 logged in again, want 2", n)
	}
}

// Agent-port connections stop at MaxAgentConns (registered agents plus
// the unadmitted ones allowed): past it a connection is refused at once
// and counted, so the descriptors above stay for the front door; the
// refused agent gets in once room frees.
func TestAgentConnsDescriptorBound(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) {
		c.MaxUnadmitted = 2
		c.MaxAgentConns = 3
	})
	a1 := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	e.startAgent("a2", "", nil)
	tunneltest.WaitUntil(t, func() bool { return e.srv.metrics.agentsRefusedFD.Value() >= 1 }, "the second agent refused for descriptors")
	if n := e.srv.AgentCount(); n != 1 {
		t.Fatalf("%d agents, bound 1", n)
	}
	echo := tunneltest.EchoServer(t)
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("front door while agents are at their bound: %v", err)
	}
	a1.Stop()
	tunneltest.WaitUntil(t, func() bool { return findAgent(e, "a2") != nil }, "a2 gets in once a1 left")
}
