package nodemap

import (
	"fmt"
	"net/netip"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/spinifex/konnectivity/internal/kubeapi"
)

const (
	benchNodes     = 5000
	benchEndpoints = 150000
	benchPerSlice  = 100
)

func benchNodeName(i int) string { return fmt.Sprintf("ip-172-20-%d-%d.ec2.internal", i/256, i%256) }

// benchPodAddr is the i-th endpoint's address: outside every pod CIDR, as
// with a CNI that gives pods VPC addresses, so every one is a map entry.
func benchPodAddr(i int) netip.Addr {
	return netip.AddrFrom4([4]byte{100, byte(64 + i>>16), byte(i >> 8), byte(i)})
}

// buildBenchTable fills a table as a 5,000-node cluster with 150,000
// EndpointSlice endpoints (slices of 100) would: each Node has an
// InternalIP, an ExternalIP, a Hostname and dual-stack pod CIDRs.
func buildBenchTable() *Table {
	tb := NewTable()
	for i := range benchNodes {
		tb.setNode(&kubeapi.Node{
			Name: benchNodeName(i),
			Addresses: []netip.Addr{
				netip.AddrFrom4([4]byte{172, 20, byte(i / 256), byte(i % 256)}),
				netip.AddrFrom4([4]byte{54, 1, byte(i / 256), byte(i % 256)}),
			},
			Hostnames: []string{benchNodeName(i)},
			PodCIDRs: []netip.Prefix{
				netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i / 256), byte(i % 256), 0}), 24),
				netip.PrefixFrom(netip.AddrFrom16([16]byte{0xfd, 0x10, 0, 0, 0, 0, byte(i / 256), byte(i % 256)}), 64),
			},
		})
	}
	for s := range benchEndpoints / benchPerSlice {
		cs := make([]claim, 0, benchPerSlice)
		for j := range benchPerSlice {
			i := s*benchPerSlice + j
			cs = append(cs, claim{addr: benchPodAddr(i), node: benchNodeName(i % benchNodes)})
		}
		tb.setClaims(fromSlices, fmt.Sprintf("ns-%d/svc-%d", s%50, s), cs)
	}
	return tb
}

func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// benchHosts are the destinations a dial looks up, in equal parts: a
// Node's InternalIP, a pod address from an EndpointSlice, an address in an
// IPv4 pod CIDR, one in an IPv6 pod CIDR, and an address nobody owns.
func benchHosts() []netip.Addr {
	var hosts []netip.Addr
	for i := 0; i < 1000; i++ {
		n := (i * 7919) % benchNodes
		hosts = append(hosts,
			netip.AddrFrom4([4]byte{172, 20, byte(n / 256), byte(n % 256)}),
			benchPodAddr((i*104729)%benchEndpoints),
			netip.AddrFrom4([4]byte{10, byte(n / 256), byte(n % 256), 77}),
			netip.AddrFrom16([16]byte{0xfd, 0x10, 0, 0, 0, 0, byte(n / 256), byte(n % 256), 15: 9}),
			netip.AddrFrom4([4]byte{192, 0, 2, byte(i)}),
		)
	}
	return hosts
}

// BenchmarkLookup reports ns/op of one lookup in a table of 5,000 Nodes
// and 150,000 endpoints, and the table's bytes on the heap.
func BenchmarkLookup(b *testing.B) {
	before := heapInUse()
	tb := buildBenchTable()
	after := heapInUse()
	hosts := benchHosts()
	for i, want := range []Match{NodeAddress, PodAddress, PodCIDR, PodCIDR, NoMatch} {
		if n, m := tb.LookupAddr(hosts[i]); m != want {
			b.Fatalf("LookupAddr(%v) = %q, %v; want %v", hosts[i], n, m, want)
		}
	}
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		tb.LookupAddr(hosts[i%len(hosts)])
	}
	// After the loop: b.Loop's first call deletes metrics reported before.
	b.ReportMetric(float64(after-before), "table-bytes")
	b.ReportMetric(float64(after-before)/benchEndpoints, "table-bytes/endpoint")
	runtime.KeepAlive(tb)
}

// BenchmarkLookupWhileUpdating is BenchmarkLookup on every CPU while one
// goroutine replaces EndpointSlices as fast as it can: a lookup waits at
// most for one slice's change.
func BenchmarkLookupWhileUpdating(b *testing.B) {
	tb := buildBenchTable()
	hosts := benchHosts()
	var stop atomic.Bool
	done := make(chan int)
	go func() {
		updates := 0
		for s := 0; !stop.Load(); s = (s + 1) % (benchEndpoints / benchPerSlice) {
			cs := make([]claim, 0, benchPerSlice)
			for j := range benchPerSlice {
				i := s*benchPerSlice + j
				cs = append(cs, claim{addr: benchPodAddr(i), node: benchNodeName((i + updates) % benchNodes)})
			}
			tb.setClaims(fromSlices, fmt.Sprintf("ns-%d/svc-%d", s%50, s), cs)
			updates++
		}
		done <- updates
	}()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			tb.LookupAddr(hosts[i%len(hosts)])
			i++
		}
	})
	b.StopTimer()
	stop.Store(true)
	b.ReportMetric(float64(<-done), "slice-updates")
}
