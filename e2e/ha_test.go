package e2e

import (
	"fmt"
	"net"
	"net/http"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// Bounds for HA convergence: generous upper limits, not expectations.
const (
	meshBound     = 30 * time.Second
	convergeBound = 30 * time.Second
)

// haAgentArgs: an agent that dials through a load balancer, with short
// reconnect delays so a test does not wait for the production backoff.
func haAgentArgs(p *pki, host string, port int, extra ...string) []string {
	return append(append(mtlsAgentArgs(p, host, port),
		"--sync-interval=100ms", "--sync-interval-cap=500ms"), extra...)
}

// waitMesh waits until every agent holds a tunnel to n servers
// (/readyz?all = 200, "connected n/n servers") and every server reports
// all agents; it returns the time that took.
func waitMesh(t *testing.T, servers []*server, agents []*agent, n int, bound time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	want := fmt.Sprintf("connected %d/%d servers", n, n)
	for _, a := range agents {
		waitReadyBody(t, a.proc, a.healthURL("/readyz?all&verbose"), http.StatusOK, want, bound-time.Since(start))
	}
	for _, s := range servers {
		s.waitAgents(t, len(agents), bound-time.Since(start))
	}
	return time.Since(start)
}

// TestHALoadBalanced: three servers behind one round-robin TCP balancer,
// five agents that only know the balancer's address.
func TestHALoadBalanced(t *testing.T) {
	dir := t.TempDir()
	p := newPKI(t, dir)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	var servers []*server
	var addrs []string
	for i := 1; i <= 3; i++ {
		s := startServerOpts(t, serverOpts{pki: p, clusterCA: p.caCert,
			extra: []string{"--server-id=s" + strconv.Itoa(i), "--server-count=3"}})
		servers = append(servers, s)
		addrs = append(addrs, "127.0.0.1:"+strconv.Itoa(s.agentPort))
	}
	lb := startProxy(t, addrs...)

	start := time.Now()
	var agents []*agent
	for i := 1; i <= 5; i++ {
		agents = append(agents, startAgentArgs(t, "a"+strconv.Itoa(i), haAgentArgs(p, "127.0.0.1", lb.port())...))
	}
	waitMesh(t, servers, agents, 3, meshBound)
	t.Logf("full mesh (5 agents x 3 servers = 15 tunnels) %v after the agents started; balancer accepted %d connections",
		time.Since(start).Round(time.Millisecond), lb.accepted.Load())

	dialers := make([]dialFunc, len(servers))
	for i, s := range servers {
		dialers[i] = s.egressDialer(t)
		checkReachable(t, dialers[i], backend, "b1", 10)
	}

	t.Run("server-replaced", func(t *testing.T) {
		// Load through the two servers that stay: it must never fail.
		loop := startDialLoop(t, backend, "b1", dialers[0], dialers[1])
		time.Sleep(300 * time.Millisecond) // some requests before the kill
		victim := servers[2]
		victim.proc.signal(t, syscall.SIGKILL)
		killed := time.Now()
		<-victim.proc.done
		// A new replica, new ID, same ports and socket path.
		victim.setArg("server-id", "s4")
		victim.launch(t)
		restarted := time.Since(killed)
		waitMesh(t, servers, agents, 3, convergeBound)
		converged := time.Since(killed)
		time.Sleep(300 * time.Millisecond) // and some after
		loop.finish(t, "dial loop through s1 and s2 while s3 was replaced by s4")
		t.Logf("s3 SIGKILLed; s4 healthy after %v; all 5 agents back at 3/3 and s4 holding all 5 after %v",
			restarted.Round(time.Millisecond), converged.Round(time.Millisecond))
		checkReachable(t, victim.egressDialer(t), backend, "b1", 10)
	})
}

// TestHAServerCountRaised: agents with --sync-forever find a server added
// later that announces a larger count.
func TestHAServerCountRaised(t *testing.T) {
	p := newPKI(t, t.TempDir())
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	var servers []*server
	var addrs []string
	for i := 1; i <= 2; i++ {
		s := startServerOpts(t, serverOpts{pki: p, clusterCA: p.caCert,
			extra: []string{"--server-id=s" + strconv.Itoa(i), "--server-count=2"}})
		servers = append(servers, s)
		addrs = append(addrs, "127.0.0.1:"+strconv.Itoa(s.agentPort))
	}
	lb := startProxy(t, addrs...)
	var agents []*agent
	for i := 1; i <= 3; i++ {
		agents = append(agents, startAgentArgs(t, "a"+strconv.Itoa(i),
			haAgentArgs(p, "127.0.0.1", lb.port(), "--sync-forever")...))
	}
	el := waitMesh(t, servers, agents, 2, meshBound)
	t.Logf("2/2 mesh after %v", el.Round(time.Millisecond))

	s3 := startServerOpts(t, serverOpts{pki: p, clusterCA: p.caCert,
		extra: []string{"--server-id=s3", "--server-count=3"}})
	added := time.Now()
	lb.setBackends(append(addrs, "127.0.0.1:"+strconv.Itoa(s3.agentPort))...)
	servers = append(servers, s3)
	waitMesh(t, servers, agents, 3, convergeBound)
	t.Logf("third server (count 3) added: all agents at 3/3 after %v", time.Since(added).Round(time.Millisecond))
	checkReachable(t, s3.egressDialer(t), backend, "b1", 5)
}

// TestHAMultiAddress: no balancer; the agent gets every server's address
// (--proxy-server-host=a,b,c) and holds a tunnel to each. The servers share
// one port on three loopback addresses, so the certificate needs all three
// IP SANs (the agent verifies the address it dialled).
func TestHAMultiAddress(t *testing.T) {
	ips := []string{"127.0.0.1", "127.0.0.2", "127.0.0.3"}
	if err := canListen(ips...); err != nil {
		t.Skipf("needs 127.0.0.2 and 127.0.0.3 on loopback (Linux): %v", err)
	}
	p := newPKI(t, t.TempDir(), net.ParseIP("127.0.0.2"), net.ParseIP("127.0.0.3"))
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	port := freePortOn(t, ips...)
	var servers []*server
	for i, ip := range ips {
		servers = append(servers, startServerOpts(t, serverOpts{pki: p, clusterCA: p.caCert,
			agentBind: ip, agentPort: port,
			extra: []string{"--server-id=s" + strconv.Itoa(i+1), "--server-count=3"}}))
	}
	a := startAgentArgs(t, "a1", haAgentArgs(p, "127.0.0.1,127.0.0.2,127.0.0.3", port)...)
	el := waitMesh(t, servers, []*agent{a}, 3, meshBound)
	t.Logf("one agent, three addresses: 3/3 after %v", el.Round(time.Millisecond))
	for _, s := range servers {
		checkReachable(t, s.egressDialer(t), backend, "b1", 5)
	}
}

// TestHABlackhole: the path between one agent and the server stops
// forwarding without closing (a dead NAT entry, a partitioned node). The
// server's PING (--keepalive-time, --ping-timeout) must drop that agent,
// and dials then go to the other agent.
func TestHABlackhole(t *testing.T) {
	p := newPKI(t, t.TempDir())
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	s := startServerOpts(t, serverOpts{pki: p, clusterCA: p.caCert,
		extra: []string{"--keepalive-time=500ms", "--ping-timeout=1s", "--backend-dial-timeout=2s"}})
	proxy := startProxy(t, "127.0.0.1:"+strconv.Itoa(s.agentPort))
	// Agent-side keepalive stays long: only the server's detection is tested.
	holed := startAgentArgs(t, "holed", haAgentArgs(p, "127.0.0.1", proxy.port(), "--keepalive-time=1h")...)
	direct := startAgentArgs(t, "direct", haAgentArgs(p, "127.0.0.1", s.agentPort, "--keepalive-time=1h")...)
	waitHTTP(t, holed.proc, holed.healthURL("/readyz"), http.StatusOK)
	waitHTTP(t, direct.proc, direct.healthURL("/readyz"), http.StatusOK)
	s.waitAgents(t, 2, startTimeout)
	d := s.egressDialer(t)
	checkReachable(t, d, backend, "b1", 4)

	proxy.blackhole()
	el := s.waitAgents(t, 1, 15*time.Second)
	t.Logf("blackholed agent dropped by the server %v after the blackhole (keepalive 500ms, ping timeout 1s)",
		el.Round(time.Millisecond))
	// With the dead agent still registered, default routing would send
	// about half of these to it (504); all must succeed via "direct".
	checkReachable(t, d, backend, "b1", 20)
}
