package nodemap

import (
	"net/netip"
	"slices"
	"strings"
	"sync"

	"github.com/spinifex/konnectivity/internal/kubeapi"
)

// Bounds on the table, far above what Kubernetes supports (5,000 nodes,
// 150,000 pods), so a broken or hostile apiserver cannot grow it without
// limit. What does not fit is left out and reported by the Watcher.
const (
	maxNodes         = 20000
	maxPodAddrs      = 500000
	maxClaimsPerItem = 2000 // pod addresses kept per EndpointSlice or Pod
	maxPodIPs        = 8    // status.podIPs kept per Pod
)

// Match says how a lookup found its node.
type Match uint8

// The ways a lookup finds a node, in the order they are tried.
const (
	NoMatch     Match = iota
	NodeAddress       // one of the Node's status.addresses
	PodAddress        // an address an EndpointSlice or Pod places on the node
	PodCIDR           // inside one of the Node's spec.podCIDRs (longest prefix)
)

// source is a kind of object that places pod addresses on nodes.
type source uint8

const (
	fromSlices source = iota // EndpointSlices
	fromPods                 // Pods
	numSources
)

// claim is one pod address an object places on a node.
type claim struct {
	addr netip.Addr
	node string
}

// owner is a node that at least one object places an address on.
type owner struct {
	node string
	refs int32 // objects that place the address on node
}

// owners are the nodes objects place one pod address on. Objects rarely
// disagree (an address reused by a new pod before the old one's
// EndpointSlice changes), so the first owner is kept inline; the address
// belongs to the owner claimed most recently.
type owners struct {
	first owner
	more  []owner
}

func (o *owners) current() string {
	if n := len(o.more); n > 0 {
		return o.more[n-1].node
	}
	return o.first.node
}

func (o *owners) add(node string) {
	if o.first.refs == 0 {
		o.first = owner{node: node, refs: 1}
		return
	}
	if o.first.node == node {
		o.first.refs++
		return
	}
	for i := range o.more {
		if o.more[i].node == node {
			o.more[i].refs++
			return
		}
	}
	o.more = append(o.more, owner{node: node, refs: 1})
}

// remove drops one reference of node; empty reports that no owner is left.
func (o *owners) remove(node string) (empty bool) {
	if o.first.node == node {
		if o.first.refs--; o.first.refs > 0 {
			return false
		}
		if len(o.more) == 0 {
			return true
		}
		o.first, o.more = o.more[0], slices.Clone(o.more[1:])
		if len(o.more) == 0 {
			o.more = nil
		}
		return false
	}
	for i := range o.more {
		if o.more[i].node == node {
			if o.more[i].refs--; o.more[i].refs <= 0 {
				o.more = slices.Delete(o.more, i, i+1)
				if len(o.more) == 0 {
					o.more = nil
				}
			}
			return false
		}
	}
	return false
}

// Table maps addresses to the nodes that own them, as the apiserver says.
// Lookups take a read lock; every change (one object's update) takes the
// write lock only for the map operations of that object, so a lookup waits
// at most for one object's change, never for a list or a decode.
//
// Memory: a Node costs about 500 bytes (its entry, its addresses and pod
// CIDRs, their index entries); a pod address about 170 bytes (its entry in
// the address map and the claim of the object that placed it), less per
// object when several EndpointSlices name one pod. BenchmarkLookup measures
// the whole: 5,000 Nodes and 150,000 endpoints take about 28 MB (figure in
// BENCHMARKS.md). With the caps above, the table cannot pass about 100 MB.
type Table struct {
	mu sync.RWMutex // guards every field below; no other lock is taken while it is held

	nodes  map[string]*kubeapi.Node       // by name
	addrs  map[netip.Addr][]string        // node address → nodes listing it (more than one: ambiguous, no route)
	hosts  map[string][]string            // Hostname address → nodes listing it
	cidrs  map[netip.Prefix][]string      // pod CIDR → nodes (more than one: ambiguous, no route)
	lens   [2][]uint8                     // prefix lengths in cidrs, longest first: [0] IPv4, [1] IPv6
	counts [2][129]int32                  // prefixes in cidrs per length, per family
	pods   map[netip.Addr]*owners         // pod address → nodes objects place it on
	claims [numSources]map[string][]claim // what each object placed, by namespace/name
}

// NewTable returns an empty table.
func NewTable() *Table {
	t := &Table{
		nodes: map[string]*kubeapi.Node{},
		addrs: map[netip.Addr][]string{},
		hosts: map[string][]string{},
		cidrs: map[netip.Prefix][]string{},
		pods:  map[netip.Addr]*owners{},
	}
	for i := range t.claims {
		t.claims[i] = map[string][]claim{}
	}
	return t
}

// Lookup returns the node that owns host, an IP address or a node's
// Hostname address: a Node address first, then a pod address an
// EndpointSlice or Pod places on a node, then the longest pod CIDR that
// holds it. An address two nodes claim at the same rank has no owner.
// A pod address is only routed to a node the table knows, so a deleted
// Node's pods stop routing with it.
func (t *Table) Lookup(host string) (string, Match) {
	host = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSuffix(host, "]"), "["), ".")
	if a, err := netip.ParseAddr(host); err == nil {
		return t.LookupAddr(a)
	}
	t.mu.RLock()
	defer t.mu.RUnlock()
	if ns, ok := t.hosts[strings.ToLower(host)]; ok && len(ns) == 1 {
		return ns[0], NodeAddress
	}
	return "", NoMatch
}

// LookupAddr is Lookup for an address.
func (t *Table) LookupAddr(a netip.Addr) (string, Match) {
	a = a.Unmap().WithZone("")
	t.mu.RLock()
	defer t.mu.RUnlock()
	if ns, ok := t.addrs[a]; ok {
		if len(ns) == 1 {
			return ns[0], NodeAddress
		}
		return "", NoMatch
	}
	if o, ok := t.pods[a]; ok {
		if n := o.current(); t.nodes[n] != nil {
			return n, PodAddress
		}
	}
	fam := 0
	if a.Is6() {
		fam = 1
	}
	for _, l := range t.lens[fam] {
		p, _ := a.Prefix(int(l))
		if ns, ok := t.cidrs[p]; ok {
			if len(ns) == 1 {
				return ns[0], PodCIDR
			}
			return "", NoMatch
		}
	}
	return "", NoMatch
}

// Size is how many Nodes and pod addresses the table holds.
func (t *Table) Size() (nodes, podAddrs int) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	return len(t.nodes), len(t.pods)
}

// setNode adds or replaces a Node; false means the table is full.
func (t *Table) setNode(n *kubeapi.Node) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	old := t.nodes[n.Name]
	if old == nil && len(t.nodes) >= maxNodes {
		return false
	}
	if old != nil {
		n.Name = old.Name // one copy of the name, shared with the pod addresses
		t.unindexNode(old)
	}
	t.nodes[n.Name] = n
	for _, a := range n.Addresses {
		t.addrs[a] = append(t.addrs[a], n.Name)
	}
	for _, h := range n.Hostnames {
		t.hosts[h] = append(t.hosts[h], n.Name)
	}
	for _, p := range n.PodCIDRs {
		t.cidrs[p] = append(t.cidrs[p], n.Name)
		fam := familyOf(p)
		if t.counts[fam][p.Bits()]++; t.counts[fam][p.Bits()] == 1 {
			t.resetLens(fam)
		}
	}
	return true
}

// deleteNode removes a Node and with it every route to it.
func (t *Table) deleteNode(name string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if old := t.nodes[name]; old != nil {
		t.unindexNode(old)
		delete(t.nodes, name)
	}
}

// unindexNode removes n's addresses and CIDRs; t.mu is held.
func (t *Table) unindexNode(n *kubeapi.Node) {
	for _, a := range n.Addresses {
		dropName(t.addrs, a, n.Name)
	}
	for _, h := range n.Hostnames {
		dropName(t.hosts, h, n.Name)
	}
	for _, p := range n.PodCIDRs {
		dropName(t.cidrs, p, n.Name)
		fam := familyOf(p)
		if t.counts[fam][p.Bits()]--; t.counts[fam][p.Bits()] == 0 {
			t.resetLens(fam)
		}
	}
}

func dropName[K comparable](m map[K][]string, k K, name string) {
	ns := m[k]
	if i := slices.Index(ns, name); i >= 0 {
		ns = slices.Delete(ns, i, i+1)
	}
	if len(ns) == 0 {
		delete(m, k)
	} else {
		m[k] = ns
	}
}

func familyOf(p netip.Prefix) int {
	if p.Addr().Is6() {
		return 1
	}
	return 0
}

// resetLens lists the prefix lengths in use for a family, longest first.
func (t *Table) resetLens(fam int) {
	t.lens[fam] = t.lens[fam][:0]
	for l := len(t.counts[fam]) - 1; l >= 0; l-- {
		if t.counts[fam][l] > 0 {
			t.lens[fam] = append(t.lens[fam], uint8(l))
		}
	}
}

// setClaims replaces the pod addresses an object places on nodes. It
// returns how many were left out because the table is full.
func (t *Table) setClaims(src source, key string, cs []claim) (dropped int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.dropClaimsLocked(src, key)
	kept := cs[:0]
	for _, c := range cs {
		o := t.pods[c.addr]
		if o == nil {
			if len(t.pods) >= maxPodAddrs {
				dropped++
				continue
			}
			o = &owners{}
			t.pods[c.addr] = o
		}
		if n := t.nodes[c.node]; n != nil {
			c.node = n.Name // share the Node's copy of the name
		}
		o.add(c.node)
		kept = append(kept, c)
	}
	if len(kept) > 0 {
		t.claims[src][key] = slices.Clip(kept)
	}
	return dropped
}

// dropClaims removes what an object placed.
func (t *Table) dropClaims(src source, key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.dropClaimsLocked(src, key)
}

func (t *Table) dropClaimsLocked(src source, key string) {
	for _, c := range t.claims[src][key] {
		if o := t.pods[c.addr]; o != nil && o.remove(c.node) {
			delete(t.pods, c.addr)
		}
	}
	delete(t.claims[src], key)
}

// keys lists the objects of a kind the table holds, for a list to drop
// those that are gone.
func (t *Table) keys(k kindID) []string {
	t.mu.RLock()
	defer t.mu.RUnlock()
	var out []string
	if k == kindNodes {
		out = make([]string, 0, len(t.nodes))
		for name := range t.nodes {
			out = append(out, name)
		}
		return out
	}
	m := t.claims[k.source()]
	out = make([]string, 0, len(m))
	for key := range m {
		out = append(out, key)
	}
	return out
}
