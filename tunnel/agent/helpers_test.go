package agent

import (
	"crypto/tls"
	"errors"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/server"
)

// env is one server, its sockets and the agents a test starts for it.
// (The server's tests have their own, for a server they look into.)
type env struct {
	*tunneltest.Ends
	srv     *server.Server
	metrics *promtext.Registry // the server's
}

func newEnv(t testing.TB, mutate func(*server.Config)) *env {
	t.Helper()
	return newEnvOn(t, tunneltest.NewPKI(t), "127.0.0.1:0", mutate)
}

// newEnvOn starts a server whose agent listener is on agentAddr, with the
// given PKI, so several servers can share one CA.
func newEnvOn(t testing.TB, p *tunneltest.PKI, agentAddr string, mutate func(*server.Config)) *env {
	t.Helper()
	cfg := server.Config{
		ID:          "s1",
		AgentTLS:    p.ServerTLS(),
		AgentWait:   500 * time.Millisecond,
		DialTimeout: 3 * time.Second,
		Logger:      tunneltest.Logger(t),
	}
	if mutate != nil {
		mutate(&cfg)
	}
	if cfg.Metrics == nil {
		cfg.Metrics = promtext.NewRegistry()
	}
	srv, err := server.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &env{Ends: tunneltest.ServeEnds(t, p, agentAddr, srv), srv: srv, metrics: cfg.Metrics}
}

// testAgent is an in-process agent and the means to stop it.
type testAgent struct {
	*Agent
	*tunneltest.Running
}

func (e *env) startAgent(id, identifiers string, mutate func(*Config)) *testAgent {
	e.T.Helper()
	return startAgentTo(e.T, e.PKI, []string{e.AgentAddr}, id, identifiers, mutate)
}

func startAgentTo(t testing.TB, p *tunneltest.PKI, addrs []string, id, identifiers string, mutate func(*Config)) *testAgent {
	t.Helper()
	return startAgentWith(t, p, addrs, id, identifiers, mutate, nil)
}

// startAgentWith is startAgentTo with before run on the agent before it
// runs (what the next image of a restarting agent does first).
func startAgentWith(t testing.TB, p *tunneltest.PKI, addrs []string, id, identifiers string, mutate func(*Config), before func(*Agent)) *testAgent {
	t.Helper()
	cfg := Config{
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
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(a)
	}
	return &testAgent{Agent: a, Running: tunneltest.RunAgent(t, a.Run)}
}

// neverTLS is the TLS of an agent a test builds but never connects.
func neverTLS(string) (*tls.Config, error) {
	return nil, errors.New("this test's agent connects to no server")
}

// dialsOK is the agent's count of destination dials that succeeded, as
// its metrics show it: dial_duration_seconds observes each of them.
func dialsOK(t testing.TB, a *Agent) int64 {
	t.Helper()
	return int64(tunneltest.Metric(t, a.cfg.Metrics, agentPrefix+"dial_duration_seconds_count"))
}

// newEchoEnv is a server with one agent and an echo destination, whose
// address it returns. The caller stops the env.
func newEchoEnv(tb testing.TB) (*env, string) {
	e := newEnv(tb, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	return e, tunneltest.EchoServer(tb)
}

// grpcSocket serves the gRPC front door on a Unix socket next to an env.
func (e *env) grpcSocket(t testing.TB) string { return e.ServeUnix(t, e.srv.ServeGRPC) }

// frontOpen is the server's count of open front door connections (HTTP
// CONNECT) and calls (gRPC), as its metrics show them.
func (e *env) frontOpen(t testing.TB) float64 {
	return tunneltest.Metric(t, e.metrics, "konnectivity_network_proxy_server_http_connections") +
		tunneltest.Metric(t, e.metrics, `konnectivity_network_proxy_server_grpc_connections{service_method="Proxy"}`)
}
