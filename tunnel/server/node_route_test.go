package server

import (
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// nodeEnv is a token server whose node map says 127.0.0.2 is node-a's,
// 127.0.0.3 node-b's and 127.0.0.4 node-c's, with agents for node-a and
// node-b (token-bound) and one whose token names no node.
func nodeEnv(t *testing.T, loaded *atomic.Bool, strategies ...Strategy) *env {
	f := newFakeTokens()
	f.addPod("tok-a", "node-a", "agent-a", "uid-a")
	f.addPod("tok-b", "node-b", "agent-b", "uid-b")
	f.add("tok-free", "", "uid-free")
	owners := map[string]string{"127.0.0.2": "node-a", "127.0.0.3": "node-b", "127.0.0.4": "node-c"}
	e := tokenEnv(t, f, nil, func(c *Config) {
		c.Strategies = strategies
		c.NodeOf = func(host string) (string, bool) { return owners[host], loaded.Load() }
	})
	noCert := func(name string) (*tls.Config, error) { return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name}, nil }
	for id, tok := range map[string]string{"node-a": "tok-a", "node-b": "tok-b", "free": "tok-free"} {
		e.startAgent(id, "", func(c *agent.Config) {
			c.TLS = noCert
			c.Token = func() (string, error) { return tok, nil }
		})
	}
	e.WaitAgents(3)
	return e
}

// echoOn is an echo destination on a loopback address other than
// 127.0.0.1, so the node map can tell destinations apart.
func echoOn(t *testing.T, ip string) string {
	t.Helper()
	ln, err := net.Listen("tcp", ip+":0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(c, c); c.Close() }()
		}
	}()
	return ln.Addr().String()
}

func nodeRoutes(e *env, result string) uint64 { return e.srv.metrics.nodeRoutes[result].Value() }

// With node first, a dial to a node's address goes to the agent bound to
// that node every time; a node without an agent, or an address no node
// owns, falls through to default.
func TestNodeStrategyRoutesToBoundAgent(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	var loaded atomic.Bool
	loaded.Store(true)
	e := nodeEnv(t, &loaded, StrategyNode, StrategyDefault)
	toA, toB := echoOn(t, "127.0.0.2"), echoOn(t, "127.0.0.3")
	var open []net.Conn
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	for range 5 {
		open = append(open, e.EchoOne(toA), e.EchoOne(toB))
	}
	for id, want := range map[string]int64{"node-a": 5, "node-b": 5, "free": 0} {
		if got := findAgent(e, id).tunnels.Load(); got != want {
			t.Errorf("agent %s carries %d tunnels, want %d", id, got, want)
		}
	}
	if n := nodeRoutes(e, nodeRouted); n != 10 {
		t.Errorf("routed = %d, want 10", n)
	}
	// node-c has no agent and 127.0.0.5 no node: default takes both.
	open = append(open, e.EchoOne(echoOn(t, "127.0.0.4")), e.EchoOne(echoOn(t, "127.0.0.5")))
	if n := nodeRoutes(e, nodeFellThrough); n != 2 {
		t.Errorf("fallen_through = %d, want 2", n)
	}
	st := e.srv.Status()
	nodes := map[string]string{}
	for _, a := range st.Agents {
		nodes[a.ID] = a.Node
	}
	if nodes["node-a"] != "node-a" || nodes["node-b"] != "node-b" || nodes["free"] != "" {
		t.Errorf("status: agents serve nodes %v", nodes)
	}
}

// With node alone, a dial it cannot route is a 503 that says why: the map
// not read yet, no agent for the owning node, or no owner.
func TestNodeStrategyLastRefusesWithReason(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	var loaded atomic.Bool
	e := nodeEnv(t, &loaded, StrategyNode)
	for _, tc := range []struct{ addr, why string }{
		{echoOn(t, "127.0.0.5"), "has not read the apiserver's Nodes and EndpointSlices yet"},
		{echoOn(t, "127.0.0.4"), `no agent bound to node "node-c" (which owns 127.0.0.4) is connected`},
		{echoOn(t, "127.0.0.5"), "no node the apiserver lists owns 127.0.0.5"},
	} {
		c, br, resp := e.Connect(tc.addr)
		msg, _ := io.ReadAll(io.LimitReader(br, 1024))
		c.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(msg)+resp.Status, tc.why) {
			t.Errorf("CONNECT %s: %s %q; want 503 saying %q", tc.addr, resp.Status, msg, tc.why)
		}
		loaded.Store(true) // after the first: the map is read
	}
	if n := nodeRoutes(e, nodeRefused); n != 3 {
		t.Errorf("refused = %d, want 3", n)
	}
	e.EchoOne(echoOn(t, "127.0.0.2")).Close()
}

func TestNodeStrategyNeedsNodeOf(t *testing.T) {
	_, err := New(Config{ID: "s1", Strategies: []Strategy{StrategyNode}})
	if err == nil || !strings.Contains(err.Error(), "NodeOf") {
		t.Fatalf("New without NodeOf: %v", err)
	}
	if _, err := ParseStrategies("node,destHost,default"); err != nil {
		t.Fatal(err)
	}
}

// A certificate agent serves the node its ID names only when certificate
// names bind IDs; a token agent serves its token's node.
func TestBoundNode(t *testing.T) {
	s := &Server{}
	cert := Principal{Kind: PrincipalCertificate, Names: []string{"Node-A"}}
	if n := s.boundNode(cert, "node-a"); n != "" {
		t.Errorf("certificate, names not binding: node %q", n)
	}
	s.cfg.Identity.CertificateNames = true
	if n := s.boundNode(cert, "Node-A"); n != "node-a" {
		t.Errorf("certificate: node %q, want node-a", n)
	}
	if n := s.boundNode(Principal{Kind: PrincipalToken, Node: "node-b"}, "agent-b"); n != "node-b" {
		t.Errorf("token: node %q, want node-b", n)
	}
	if n := s.boundNode(Principal{}, "node-a"); n != "" {
		t.Errorf("no credential: node %q", n)
	}
}
