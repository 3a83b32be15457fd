package server

import (
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// env is one server, its sockets and the agents a test starts for it.
type env struct {
	*tunneltest.Ends
	srv *Server
}

func newEnv(t testing.TB, mutate func(*Config)) *env {
	t.Helper()
	return newEnvOn(t, tunneltest.NewPKI(t), "127.0.0.1:0", mutate)
}

// newEnvOn starts a server whose agent listener is on agentAddr, with the
// given PKI, so several servers can share one CA.
func newEnvOn(t testing.TB, p *tunneltest.PKI, agentAddr string, mutate func(*Config)) *env {
	t.Helper()
	cfg := Config{
		ID:          "s1",
		AgentTLS:    p.ServerTLS(),
		AgentWait:   500 * time.Millisecond,
		DialTimeout: 3 * time.Second,
		Logger:      tunneltest.Logger(t),
	}
	if mutate != nil {
		mutate(&cfg)
	}
	srv, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &env{Ends: tunneltest.ServeEnds(t, p, agentAddr, srv), srv: srv}
}

// testAgent is an in-process agent and the means to stop it.
type testAgent struct {
	*agent.Agent
	*tunneltest.Running
	t       testing.TB
	metrics *promtext.Registry // the agent's
}

// dialsOK is the agent's count of destination dials that succeeded, as
// its metrics show it: dial_duration_seconds observes each of them.
func (a *testAgent) dialsOK() int64 {
	a.t.Helper()
	return int64(tunneltest.Metric(a.t, a.metrics, "konnectivity_network_proxy_agent_dial_duration_seconds_count"))
}

func (e *env) startAgent(id, identifiers string, mutate func(*agent.Config)) *testAgent {
	e.T.Helper()
	return startAgentTo(e.T, e.PKI, []string{e.AgentAddr}, id, identifiers, mutate)
}

func startAgentTo(t testing.TB, p *tunneltest.PKI, addrs []string, id, identifiers string, mutate func(*agent.Config)) *testAgent {
	t.Helper()
	return startAgentWith(t, p, addrs, id, identifiers, mutate, nil)
}

// startAgentWith is startAgentTo with before run on the agent before it
// runs (what the next image of a restarting agent does first).
func startAgentWith(t testing.TB, p *tunneltest.PKI, addrs []string, id, identifiers string, mutate func(*agent.Config), before func(*agent.Agent)) *testAgent {
	t.Helper()
	cfg := agent.Config{
		ServerAddrs:  addrs,
		ID:           id,
		Identifiers:  identifiers,
		DrainTimeout: 2 * time.Second,
		SyncInterval: 20 * time.Millisecond,
		SyncCap:      100 * time.Millisecond,
		Logger:       tunneltest.Logger(t),
		TLS:          p.AgentTLS,
	}
	if mutate != nil {
		mutate(&cfg)
	}
	if cfg.Metrics == nil {
		cfg.Metrics = promtext.NewRegistry()
	}
	a, err := agent.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(a)
	}
	return &testAgent{Agent: a, Running: tunneltest.RunAgent(t, a.Run), t: t, metrics: cfg.Metrics}
}

// newEchoEnv is a server with one agent and an echo destination, whose
// address it returns. The caller stops the env.
func newEchoEnv(tb testing.TB) (*env, string) {
	e := newEnv(tb, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	return e, tunneltest.EchoServer(tb)
}

// agentDraining reports whether s's status shows the agent id draining.
func agentDraining(s *Server, id string) bool {
	for _, a := range s.Status().Agents {
		if a.ID == id {
			return a.Draining
		}
	}
	return false
}

// frontOpen is the server's count of open front door connections (HTTP
// CONNECT) and calls (gRPC), as its metrics show them.
func frontOpen(s *Server) int64 {
	return s.metrics.httpConns.Value() + s.metrics.grpcConns.Value()
}
