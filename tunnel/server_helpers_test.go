package tunnel

import (
	"testing"
	"time"
)

// env is one server, its sockets and the agents a test starts for it.
type env struct {
	*ends
	srv *Server
}

func newEnv(t testing.TB, mutate func(*ServerConfig)) *env {
	t.Helper()
	return newEnvOn(t, newPKI(t), "127.0.0.1:0", mutate)
}

// newEnvOn starts a server whose agent listener is on agentAddr, with the
// given PKI, so several servers can share one CA.
func newEnvOn(t testing.TB, p *pki, agentAddr string, mutate func(*ServerConfig)) *env {
	t.Helper()
	cfg := ServerConfig{
		ID:          "s1",
		AgentTLS:    p.serverTLS(),
		AgentWait:   500 * time.Millisecond,
		DialTimeout: 3 * time.Second,
		Logger:      testLogger(t),
	}
	if mutate != nil {
		mutate(&cfg)
	}
	srv, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &env{ends: serveEnds(t, p, agentAddr, srv), srv: srv}
}

// testAgent is an in-process agent and the means to stop it.
type testAgent struct {
	*Agent
	*running
}

func (e *env) startAgent(id, identifiers string, mutate func(*AgentConfig)) *testAgent {
	e.t.Helper()
	return startAgentTo(e.t, e.pki, []string{e.agentAddr}, id, identifiers, mutate)
}

func startAgentTo(t testing.TB, p *pki, addrs []string, id, identifiers string, mutate func(*AgentConfig)) *testAgent {
	t.Helper()
	return startAgentWith(t, p, addrs, id, identifiers, mutate, nil)
}

// startAgentWith is startAgentTo with before run on the agent before it
// runs (what the next image of a restarting agent does first).
func startAgentWith(t testing.TB, p *pki, addrs []string, id, identifiers string, mutate func(*AgentConfig), before func(*Agent)) *testAgent {
	t.Helper()
	cfg := AgentConfig{
		ServerAddrs:  addrs,
		ID:           id,
		Identifiers:  identifiers,
		DrainTimeout: 2 * time.Second,
		SyncInterval: 20 * time.Millisecond,
		SyncCap:      100 * time.Millisecond,
		Logger:       testLogger(t),
		TLS:          p.agentTLS,
	}
	if mutate != nil {
		mutate(&cfg)
	}
	a, err := NewAgent(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(a)
	}
	return &testAgent{Agent: a, running: runAgent(t, a.Run)}
}

// newEchoEnv is a server with one agent and an echo destination, whose
// address it returns. The caller stops the env.
func newEchoEnv(tb testing.TB) (*env, string) {
	e := newEnv(tb, nil)
	e.startAgent("a1", "", nil)
	e.waitAgents(1)
	return e, echoServer(tb)
}
