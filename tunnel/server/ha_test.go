package server

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// cluster is several servers sharing one CA, as HA control planes run them.
type cluster struct {
	t       *testing.T
	pki     *tunneltest.PKI
	servers []*env
}

func newCluster(t *testing.T, n int, mutate func(*Config)) *cluster {
	c := &cluster{t: t, pki: tunneltest.NewPKI(t)}
	for i := range n {
		c.servers = append(c.servers, c.start(fmt.Sprintf("s%d", i+1), "127.0.0.1:0", mutate))
	}
	return c
}

func (c *cluster) start(id, agentAddr string, mutate func(*Config)) *env {
	return newEnvOn(c.t, c.pki, agentAddr, func(cfg *Config) {
		cfg.ID = id
		cfg.Count = len(c.servers) + 1
		if mutate != nil {
			mutate(cfg)
		}
	})
}

func (c *cluster) agentAddrs() []string {
	var out []string
	for _, s := range c.servers {
		out = append(out, s.AgentAddr)
	}
	return out
}

// waitMesh waits until every server has n agents and returns how long it took.
func (c *cluster) waitMesh(servers []*env, n int, within time.Duration) time.Duration {
	c.t.Helper()
	start := time.Now()
	for {
		ok := true
		for _, s := range servers {
			if s.srv.AgentCount() != n {
				ok = false
			}
		}
		if ok {
			return time.Since(start)
		}
		if time.Since(start) > within {
			for _, s := range servers {
				c.t.Logf("server %s: %d agents", s.srv.cfg.ID, s.srv.AgentCount())
			}
			c.t.Fatalf("no full mesh of %d agents within %s", n, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func haAgentConfig(c *agent.Config) {
	c.SyncInterval = 50 * time.Millisecond
	c.SyncCap = 200 * time.Millisecond
}

func TestFullMeshThroughLoadBalancer(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	c := newCluster(t, 3, func(cfg *Config) { cfg.Count = 3 })
	lb := tunneltest.NewLB(t, c.agentAddrs()...)
	for i := range 5 {
		startAgentTo(t, c.pki, []string{lb.Addr()}, fmt.Sprintf("agent-%d", i), "", haAgentConfig)
	}
	took := c.waitMesh(c.servers, 5, 10*time.Second)
	t.Logf("full mesh of 5 agents x 3 servers in %s", took)
	echo := tunneltest.EchoServer(t)
	for _, s := range c.servers {
		conn, _, resp := s.Connect(echo)
		conn.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("server %s: %s", s.srv.cfg.ID, resp.Status)
		}
	}
}

// A server replaced by one with a new ID: agents converge to it, and dials
// through the other servers never fail meanwhile.
func TestServerReplacedAgentsConverge(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	c := newCluster(t, 3, func(cfg *Config) { cfg.Count = 3 })
	lb := tunneltest.NewLB(t, c.agentAddrs()...)
	var agents []*testAgent
	for i := range 3 {
		agents = append(agents, startAgentTo(t, c.pki, []string{lb.Addr()}, fmt.Sprintf("agent-%d", i), "", haAgentConfig))
	}
	c.waitMesh(c.servers, 3, 10*time.Second)
	echo := tunneltest.EchoServer(t)

	stop := make(chan struct{})
	var failures, dials atomic.Int64
	var wg sync.WaitGroup
	for _, s := range c.servers[1:] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				conn, _, resp := s.Connect(echo)
				conn.Close()
				dials.Add(1)
				if resp.StatusCode != 200 {
					failures.Add(1)
				}
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}
	old := c.servers[0]
	old.Stop()
	replacement := c.start("s1-new", old.AgentAddr, func(cfg *Config) { cfg.Count = 3 })
	took := c.waitMesh([]*env{replacement, c.servers[1], c.servers[2]}, 3, 10*time.Second)
	close(stop)
	wg.Wait()
	t.Logf("agents converged on the replacement in %s; %d dials through the others, %d failed", took, dials.Load(), failures.Load())
	if failures.Load() != 0 {
		t.Fatalf("%d of %d dials through the surviving servers failed", failures.Load(), dials.Load())
	}
	for _, a := range agents {
		tunneltest.WaitUntil(t, func() bool { st := a.Status(); n, want := st.Connected, st.Want; return n == 3 && want == 3 }, "agent holds 3/3")
	}
}

// A blackholed agent connection (no FIN, nothing forwarded) is noticed by
// PING on both sides; the server stops routing to it.
func TestBlackholedAgentDropped(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	keep := func(cfg *Config) {
		cfg.KeepAlive = 100 * time.Millisecond
		cfg.PingTimeout = 300 * time.Millisecond
	}
	c := newCluster(t, 1, keep)
	s := c.servers[0]
	lb := tunneltest.NewLB(t, s.AgentAddr)
	startAgentTo(t, c.pki, []string{lb.Addr()}, "behind-blackhole", "", func(cfg *agent.Config) {
		haAgentConfig(cfg)
		cfg.KeepAlive = 100 * time.Millisecond
		cfg.PingTimeout = 300 * time.Millisecond
	})
	s.WaitAgents(1)
	good := s.startAgent("direct", "", nil)
	s.WaitAgents(2)

	lb.Blackhole()
	start := time.Now()
	s.WaitAgents(1)
	t.Logf("blackholed agent dropped after %s (keepalive 100ms + ping timeout 300ms)", time.Since(start))
	echo := tunneltest.EchoServer(t)
	before := good.dialsOK()
	for range 10 {
		conn, _, resp := s.Connect(echo)
		conn.Close()
		if resp.StatusCode != 200 {
			t.Fatal(resp.Status)
		}
	}
	if good.dialsOK() != before+10 {
		t.Fatal("dials did not go to the remaining agent")
	}
}

// Raising the server count: agents with --sync-forever find a server added
// behind the balancer and adopt its larger count.
func TestServerCountRaised(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	c := newCluster(t, 2, func(cfg *Config) { cfg.Count = 2 })
	lb := tunneltest.NewLB(t, c.agentAddrs()...)
	a := startAgentTo(t, c.pki, []string{lb.Addr()}, "a", "", func(cfg *agent.Config) {
		haAgentConfig(cfg)
		cfg.SyncForever = true
	})
	c.waitMesh(c.servers, 1, 10*time.Second)
	third := c.start("s3", "127.0.0.1:0", func(cfg *Config) { cfg.Count = 3 })
	lb.SetBackends(append(c.agentAddrs(), third.AgentAddr)...)
	c.waitMesh([]*env{c.servers[0], c.servers[1], third}, 1, 10*time.Second)
	tunneltest.WaitUntil(t, func() bool { st := a.Status(); n, want := st.Connected, st.Want; return n == 3 && want == 3 }, "agent holds 3/3")
	if ok, msg := a.ReadyAll(); !ok {
		t.Fatalf("ReadyAll: %s", msg)
	}
}

// Without a load balancer: a list of addresses, or one name that resolves
// to every server.
func TestMultiAddressAndDNSFanOut(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	c := &cluster{t: t, pki: tunneltest.NewPKI(t)}
	// Every server listens on its own loopback address, same port.
	probe, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(probe.Addr().String())
	probe.Close()
	c.pki.ServerCert = c.pki.Issue(t, tunneltest.CertRequestFor("servers.test", "127.0.0.1", "127.0.0.2", "127.0.0.3"))
	for i := range 3 {
		c.servers = append(c.servers, c.start(fmt.Sprintf("s%d", i+1), fmt.Sprintf("127.0.0.%d:%s", i+1, port), func(cfg *Config) { cfg.Count = 3 }))
	}
	startAgentTo(t, c.pki, c.agentAddrs(), "listed", "", haAgentConfig)
	c.waitMesh(c.servers, 1, 10*time.Second)

	resolver := func(ctx context.Context, host string) ([]netip.Addr, error) {
		if host != "servers.test" {
			return nil, fmt.Errorf("unknown host %s", host)
		}
		return []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.3")}, nil
	}
	a := startAgentTo(t, c.pki, []string{net.JoinHostPort("servers.test", port)}, "resolved", "", func(cfg *agent.Config) {
		haAgentConfig(cfg)
		cfg.ExpandDNS = true
		cfg.Resolver = resolver
	})
	c.waitMesh(c.servers, 2, 10*time.Second)
	tunneltest.WaitUntil(t, func() bool { n := a.Status().Connected; return n == 3 }, "DNS-expanded agent holds 3 servers")
}

// An agent that drains is avoided while another agent fits, and still
// used when none does.
func TestAgentDrainPrefersOthers(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	draining := e.startAgent("draining", "", func(c *agent.Config) { c.DrainTimeout = 3 * time.Second })
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)
	// Hold a tunnel open so the drain has something to wait for.
	held, _, resp := e.Connect(echo)
	defer held.Close()
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	other := e.startAgent("other", "", nil)
	e.WaitAgents(2)
	draining.Cancel()
	deadline := time.Now().Add(5 * time.Second)
	for !agentDraining(e.srv, "draining") {
		if time.Now().After(deadline) {
			t.Fatal("server never saw the drain")
		}
		time.Sleep(5 * time.Millisecond)
	}
	before := draining.dialsOK()
	for range 10 {
		conn, _, resp := e.Connect(echo)
		conn.Close()
		if resp.StatusCode != 200 {
			t.Fatal(resp.Status)
		}
	}
	if draining.dialsOK() != before || other.dialsOK() < 10 {
		t.Fatalf("dials went to the draining agent: draining=%d other=%d", draining.dialsOK()-before, other.dialsOK())
	}
	held.Close()
	<-draining.Done
}
