package server

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// BenchmarkFullMesh measures, with production timings (sync interval 1s,
// cap 10s), how long N agents behind a round-robin load balancer take to
// hold a connection to each of 3 servers, and how long each agent takes to be
// back at 3/3 after one server is replaced, counted from the moment the
// replacement listens. Run: go test -run '^$' -bench FullMesh -benchtime 1x ./tunnel/
func BenchmarkFullMesh(b *testing.B) {
	for _, agents := range []int{1, 10, 100} {
		b.Run(fmt.Sprintf("agents=%d", agents), func(b *testing.B) {
			for range b.N {
				mesh, p50, p99 := fullMeshOnce(b, agents)
				b.ReportMetric(float64(mesh.Milliseconds()), "ms-to-full-mesh")
				b.ReportMetric(float64(p50.Milliseconds()), "ms-reconnect-p50")
				b.ReportMetric(float64(p99.Milliseconds()), "ms-reconnect-p99")
			}
		})
	}
}

func fullMeshOnce(b *testing.B, n int) (mesh, p50, p99 time.Duration) {
	p := tunneltest.NewPKI(b)
	var servers []*env
	for i := range 3 {
		servers = append(servers, newEnvOn(b, p, "127.0.0.1:0", func(c *Config) { c.ID = fmt.Sprintf("s%d", i+1); c.Count = 3 }))
	}
	addrs := []string{servers[0].AgentAddr, servers[1].AgentAddr, servers[2].AgentAddr}
	lb := tunneltest.NewLB(b, addrs...)
	start := time.Now()
	var agents []*testAgent
	for i := range n {
		agents = append(agents, startAgentTo(b, p, []string{lb.Addr()}, fmt.Sprintf("agent-%d", i), "", func(c *agent.Config) {
			c.SyncInterval, c.SyncCap = time.Second, 10*time.Second // the production defaults
		}))
	}
	waitAll := func(what string) {
		deadline := time.Now().Add(60 * time.Second)
		for {
			done := true
			for _, a := range agents {
				if st := a.Status(); st.Connected < 3 || st.Want < 3 {
					done = false
					break
				}
			}
			if done {
				return
			}
			if time.Now().After(deadline) {
				b.Fatalf("%s: not all agents at 3/3 within 60s", what)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	waitAll("full mesh")
	mesh = time.Since(start)

	// Replace server 1; time each agent's return to 3/3 from the moment the
	// new server listens.
	old := servers[0]
	old.Stop()
	waitGone := time.Now().Add(30 * time.Second)
	for {
		all := true
		for _, a := range agents {
			if n := a.Status().Connected; n != 2 {
				all = false
			}
		}
		if all || time.Now().After(waitGone) {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	replacement := newEnvOn(b, p, old.AgentAddr, func(c *Config) { c.ID = "s1-new"; c.Count = 3 })
	_ = replacement
	back := time.Now()
	times := make([]time.Duration, len(agents))
	var wg sync.WaitGroup
	for i, a := range agents {
		wg.Add(1)
		go func() {
			defer wg.Done()
			deadline := time.Now().Add(60 * time.Second)
			for time.Now().Before(deadline) {
				if n := a.Status().Connected; n == 3 {
					times[i] = time.Since(back)
					return
				}
				time.Sleep(2 * time.Millisecond)
			}
			times[i] = 60 * time.Second
		}()
	}
	wg.Wait()
	slices.Sort(times)
	p50 = times[len(times)/2]
	p99 = times[min(len(times)-1, len(times)*99/100)]
	b.Logf("%d agents: full mesh in %s; after a server replacement, back at 3/3 in p50 %s, p99 %s (max %s)",
		n, mesh.Round(time.Millisecond), p50.Round(time.Millisecond), p99.Round(time.Millisecond), times[len(times)-1].Round(time.Millisecond))
	return mesh, p50, p99
}
