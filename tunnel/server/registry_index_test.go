package server

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"testing"

	"github.com/spinifex/konnectivity/tunnel/wire"
)

// indexedAgent is a registered agent for the index's tests: an upstream
// agent's entry, whose usable reads no link.
func indexedAgent(id, ids, node string) *agentConn {
	parsed, err := wire.ParseIdentifiers(ids)
	if err != nil {
		panic(err)
	}
	return &agentConn{id: id, ids: parsed, node: node, opener: &upstreamAgent{}}
}

// Ranks of matchHost: an exact host or address beats a CIDR that contains
// the address.
const (
	noMatch = iota
	cidrMatch
	exactMatch
)

// matchHost says how well ids name the host part of a dial address, by
// visiting each identifier: the rule the index's destHost lookup keeps.
func matchHost(ids wire.Identifiers, host string) int {
	if addr, err := netip.ParseAddr(host); err == nil {
		addr = addr.Unmap()
		for _, a := range ids.Addrs {
			if a.Unmap() == addr {
				return exactMatch
			}
		}
		for _, p := range ids.CIDRs {
			if p.Contains(addr) {
				return cidrMatch
			}
		}
		return noMatch
	}
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	for _, h := range ids.Hosts {
		if strings.TrimSuffix(h, ".") == host {
			return exactMatch
		}
	}
	return noMatch
}

// bestByScan is the choice every strategy defines, found by visiting every
// agent: the set of agents pick may return, and the strategy that found
// them.
func bestByScan(r *registry, d dest, strategies []Strategy, maxStreams int64, exclude map[*agentConn]bool) (map[*agentConn]bool, Strategy) {
	for _, st := range strategies {
		best := map[*agentConn]bool{}
		bestRank := 0
		for _, a := range r.agents {
			if exclude[a] || !a.usable(maxStreams) {
				continue
			}
			rank := 0
			switch st {
			case StrategyDefault:
				rank = 1
			case StrategyDefaultRoute:
				if a.ids.DefaultRoute {
					rank = 1
				}
			case StrategyDestHost:
				rank = matchHost(a.ids, d.host)
			case StrategyNode:
				if d.node != "" && a.node == d.node {
					rank = 1
				}
			}
			if rank == 0 {
				continue
			}
			if !a.draining.Load() {
				rank += 10
			}
			switch {
			case rank > bestRank:
				best, bestRank = map[*agentConn]bool{a: true}, rank
			case rank == bestRank:
				best[a] = true
			}
		}
		if len(best) > 0 {
			return best, st
		}
	}
	return nil, ""
}

func TestPickIndexCases(t *testing.T) {
	const maxStreams = 2
	r := newRegistry()
	exact := indexedAgent("exact", "host=Node1.Example&ipv4=10.0.0.5&ipv6=fd00::5", "n1")
	wide := indexedAgent("wide", "cidr=10.0.0.0/8&cidr=fd00::/16", "")
	narrow := indexedAgent("narrow", "cidr=10.0.0.0/24&default-route=true", "n2")
	plain := indexedAgent("plain", "", "")
	for _, a := range []*agentConn{exact, wide, narrow, plain} {
		addAgent(r, a)
	}
	one := func(a *agentConn) map[*agentConn]bool { return map[*agentConn]bool{a: true} }
	all := []Strategy{StrategyDestHost, StrategyNode, StrategyDefaultRoute, StrategyDefault}
	cases := []struct {
		name   string
		setup  func()
		d      dest
		sts    []Strategy
		want   map[*agentConn]bool
		wantSt Strategy
	}{
		{name: "host exact, case and trailing dot", d: dest{host: "node1.example."}, sts: all, want: one(exact), wantSt: StrategyDestHost},
		{name: "ipv4 exact beats cidr", d: dest{host: "10.0.0.5"}, sts: all, want: one(exact), wantSt: StrategyDestHost},
		{name: "ipv4-mapped ipv6 is the ipv4 address", d: dest{host: "::ffff:10.0.0.5"}, sts: all, want: one(exact), wantSt: StrategyDestHost},
		{name: "ipv6 exact", d: dest{host: "fd00::5"}, sts: all, want: one(exact), wantSt: StrategyDestHost},
		{name: "every containing cidr ranks the same", d: dest{host: "10.0.0.9"}, sts: all, want: map[*agentConn]bool{wide: true, narrow: true}, wantSt: StrategyDestHost},
		{name: "ipv6 cidr", d: dest{host: "fd00::9"}, sts: all, want: one(wide), wantSt: StrategyDestHost},
		{name: "no match falls to node", d: dest{host: "192.168.0.1", node: "n2"}, sts: all, want: one(narrow), wantSt: StrategyNode},
		{name: "then defaultRoute", d: dest{host: "192.168.0.1"}, sts: all, want: one(narrow), wantSt: StrategyDefaultRoute},
		{name: "full agent skipped", setup: func() { exact.tunnels.Store(maxStreams) }, d: dest{host: "10.0.0.5"}, sts: all, want: map[*agentConn]bool{wide: true, narrow: true}, wantSt: StrategyDestHost},
		{name: "draining exact loses to live cidr", setup: func() { exact.tunnels.Store(0); exact.draining.Store(true) }, d: dest{host: "10.0.0.5"}, sts: all, want: map[*agentConn]bool{wide: true, narrow: true}, wantSt: StrategyDestHost},
		{name: "draining exact beats draining cidr", setup: func() { wide.draining.Store(true); narrow.draining.Store(true) }, d: dest{host: "10.0.0.5"}, sts: all, want: one(exact), wantSt: StrategyDestHost},
		{name: "default prefers live", d: dest{host: "x"}, sts: []Strategy{StrategyDefault}, want: one(plain), wantSt: StrategyDefault},
		{name: "removed agent gone", setup: func() { r.remove(plain) }, d: dest{host: "x"}, sts: []Strategy{StrategyDefault}, want: map[*agentConn]bool{exact: true, wide: true, narrow: true}, wantSt: StrategyDefault},
		{name: "replaced agent's identifiers gone", setup: func() { addAgent(r, indexedAgent("exact", "host=other", "")) }, d: dest{host: "10.0.0.5"}, sts: []Strategy{StrategyDestHost}, want: map[*agentConn]bool{wide: true, narrow: true}, wantSt: StrategyDestHost},
		{name: "none", d: dest{host: "node1.example"}, sts: []Strategy{StrategyDestHost, StrategyNode}, want: nil},
	}
	for _, tc := range cases {
		if tc.setup != nil {
			tc.setup()
		}
		ref, refSt := bestByScan(r, tc.d, tc.sts, maxStreams, nil)
		if len(ref) != len(tc.want) || refSt != tc.wantSt {
			t.Fatalf("%s: the scan's choice %v by %q, the case says %v by %q", tc.name, ref, refSt, tc.want, tc.wantSt)
		}
		seen := map[*agentConn]bool{}
		for range 2 * len(tc.want) {
			a, st := r.pick(tc.d, tc.sts, maxStreams, nil)
			if st != tc.wantSt || (a == nil) != (tc.want == nil) || (a != nil && !tc.want[a]) {
				t.Fatalf("%s: pick = %v by %q, want one of %v by %q", tc.name, a, st, tc.want, tc.wantSt)
			}
			seen[a] = true
		}
		if tc.want != nil && len(seen) != len(tc.want) {
			t.Errorf("%s: successive picks used %d of %d equal agents, want a rotation over all", tc.name, len(seen), len(tc.want))
		}
	}
}

// TestPickIndexMatchesScan checks pick against a visit of every agent over
// random fleets: registrations, replacements, removals, drains, full
// agents and exclusions.
func TestPickIndexMatchesScan(t *testing.T) {
	const maxStreams = 1
	rng := rand.New(rand.NewPCG(1, 2))
	r := newRegistry()
	hosts := []string{"a", "b.example", "10.1.0.1", "10.1.2.3", "fd00::1", "fd00:1::7", "192.168.1.1", "c"}
	idsOf := func() string {
		pool := []string{"host=a", "host=B.example.", "ipv4=10.1.0.1", "ipv6=fd00::1", "cidr=10.1.0.0/16", "cidr=10.0.0.0/8", "cidr=10.1.2.0/24", "cidr=fd00::/8", "default-route=true", "ipv4=10.1.2.3"}
		s := ""
		for _, p := range pool {
			if rng.IntN(4) == 0 {
				s += p + "&"
			}
		}
		return s
	}
	strategies := [][]Strategy{
		{StrategyDestHost, StrategyDefault},
		{StrategyNode, StrategyDestHost},
		{StrategyDefaultRoute, StrategyDestHost, StrategyDefault},
		{StrategyDestHost},
	}
	var live []*agentConn
	for step := range 3000 {
		switch k := rng.IntN(10); {
		case k < 4 || len(live) == 0:
			a := indexedAgent(fmt.Sprintf("agent-%d", rng.IntN(60)), idsOf(), fmt.Sprintf("n%d", rng.IntN(5)))
			if old := addAgent(r, a); old != nil {
				for i, b := range live {
					if b == old {
						live = append(live[:i], live[i+1:]...)
						break
					}
				}
			}
			live = append(live, a)
		case k < 5:
			i := rng.IntN(len(live))
			r.remove(live[i])
			live = append(live[:i], live[i+1:]...)
		case k < 6:
			live[rng.IntN(len(live))].draining.Store(rng.IntN(2) == 0)
		case k < 7:
			live[rng.IntN(len(live))].tunnels.Store(int64(rng.IntN(2)))
		default:
			d := dest{host: hosts[rng.IntN(len(hosts))], node: fmt.Sprintf("n%d", rng.IntN(6))}
			sts := strategies[rng.IntN(len(strategies))]
			exclude := map[*agentConn]bool{}
			if rng.IntN(3) == 0 {
				exclude[live[rng.IntN(len(live))]] = true
			}
			want, wantSt := bestByScan(r, d, sts, maxStreams, exclude)
			a, st := r.pick(d, sts, maxStreams, exclude)
			if st != wantSt || (a == nil) != (want == nil) || (a != nil && !want[a]) {
				t.Fatalf("step %d: pick(%+v, %v) = %v by %q, want one of %d agents by %q", step, d, sts, a, st, len(want), wantSt)
			}
		}
	}
	if len(r.idx.all.list) != len(r.agents) {
		t.Fatalf("index holds %d agents, registry %d", len(r.idx.all.list), len(r.agents))
	}
}

func TestPickIndexEmptiesOnRemove(t *testing.T) {
	r := newRegistry()
	var agents []*agentConn
	for i := range 50 {
		a := indexedAgent(fmt.Sprintf("a%d", i), fmt.Sprintf("host=h%d&ipv4=10.0.0.%d&cidr=10.%d.0.0/16&default-route=true", i, i, i), fmt.Sprintf("n%d", i))
		addAgent(r, a)
		agents = append(agents, a)
	}
	for _, a := range agents {
		r.remove(a)
	}
	idx := r.idx
	if len(idx.all.list)+len(idx.all.pos)+len(idx.defaultRoute.list)+len(idx.hosts)+len(idx.addrs)+len(idx.cidrs)+len(idx.nodes) != 0 {
		t.Fatalf("index not empty after every agent left: %+v", idx)
	}
	for n, c := range idx.cidrBits4 {
		if c != 0 {
			t.Fatalf("%d IPv4 prefixes of length %d counted after every agent left", c, n)
		}
	}
}

// BenchmarkPick is one dial's agent choice at 1 and 5,000 agents: the time
// per op must not grow with the number of agents.
func BenchmarkPick(b *testing.B) {
	for _, n := range []int{1, 5000} {
		r := newRegistry()
		for i := range n {
			addr := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
			addAgent(r, indexedAgent(fmt.Sprintf("agent-%d", i), fmt.Sprintf("host=node-%d&ipv4=%s&cidr=%s/32", i, addr, addr), fmt.Sprintf("node-%d", i)))
		}
		for _, bc := range []struct {
			name string
			d    dest
			sts  []Strategy
		}{
			{"default", dest{host: "10.200.0.1"}, []Strategy{StrategyDefault}},
			{"destHost", dest{host: fmt.Sprintf("node-%d", n-1)}, []Strategy{StrategyDestHost, StrategyDefault}},
			{"destHostCIDR", dest{host: "10.0.0.0"}, []Strategy{StrategyDestHost, StrategyDefault}},
			{"node", dest{host: "10.200.0.1", node: "node-0"}, []Strategy{StrategyNode, StrategyDefault}},
		} {
			b.Run(fmt.Sprintf("agents=%d/%s", n, bc.name), func(b *testing.B) {
				b.ReportAllocs()
				for b.Loop() {
					if a, _ := r.pick(bc.d, bc.sts, 100, nil); a == nil {
						b.Fatal("no agent")
					}
				}
			})
		}
	}
}

// TestArrivalWakesOnlyItsWaiters: a resume waiting for one agent is woken
// when that agent joins, or by wake, and not by any other agent joining:
// a fleet logging in after a restart wakes each resume once.
func TestArrivalWakesOnlyItsWaiters(t *testing.T) {
	r := newRegistry()
	closed := func(ch <-chan struct{}) bool {
		select {
		case <-ch:
			return true
		default:
			return false
		}
	}
	a, ch := r.arrival("a", nil)
	if a != nil || ch == nil {
		t.Fatalf("arrival before the agent joined: %v %v", a, ch)
	}
	if _, ch2 := r.arrival("a", nil); ch2 != ch {
		t.Fatal("two waiters for one agent got different channels")
	}
	for i := range 100 {
		b := indexedAgent(fmt.Sprintf("b%d", i), "", "")
		b.canPause = true
		addAgent(r, b)
	}
	if closed(ch) {
		t.Fatal("other agents joining woke the waiter for a")
	}
	ag := indexedAgent("a", "", "")
	addAgent(r, ag) // cannot take a tunnel back: its waiter looks, and waits on
	if !closed(ch) {
		t.Fatal("agent a joining did not wake its waiter")
	}
	got, ch3 := r.arrival("a", nil)
	if got != nil || ch3 == nil || closed(ch3) {
		t.Fatalf("an agent that cannot take a tunnel back was returned: %v", got)
	}
	ag2 := indexedAgent("a", "", "")
	ag2.canPause = true
	addAgent(r, ag2)
	if !closed(ch3) {
		t.Fatal("agent a joining again did not wake its waiter")
	}
	if got, _ := r.arrival("a", nil); got != ag2 {
		t.Fatalf("arrival = %v, want the agent that joined", got)
	}
	_, ch4 := r.arrival("c", nil)
	r.wake()
	if !closed(ch4) {
		t.Fatal("wake did not wake a waiter")
	}
	if len(r.arrivals) != 0 {
		t.Fatalf("%d channels left after every waiter was woken", len(r.arrivals))
	}
}

// addAgent registers a as a login's claim does, with no bound.
func addAgent(r *registry, a *agentConn) *agentConn {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.addLocked(a)
}
