package server

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
)

// agentIndex is the registry's view of its agents by what a strategy asks
// for, so a dial looks up the agents that match its destination instead of
// visiting every agent. It is guarded by registry.mu; an agent's entries are
// made when it registers and removed when it leaves or is replaced (an
// agent's identifiers and node are fixed at login).
type agentIndex struct {
	all          agentSet                      // every agent: default
	defaultRoute agentSet                      // agents with default-route=true: defaultRoute
	hosts        map[string][]*agentConn       // destHost: by host name as given, without a trailing dot
	addrs        map[netip.Addr][]*agentConn   // destHost: by ipv4=/ipv6= address, unmapped
	cidrs        map[netip.Prefix][]*agentConn // destHost: by cidr= prefix, masked
	cidrBits4    [33]int                       // prefixes in cidrs per length, IPv4
	cidrBits6    [129]int                      // prefixes in cidrs per length, IPv6
	nodes        map[string][]*agentConn       // node: by the node the agent's credential binds it to
}

func newAgentIndex() agentIndex {
	return agentIndex{
		all:          newAgentSet(),
		defaultRoute: newAgentSet(),
		hosts:        map[string][]*agentConn{},
		addrs:        map[netip.Addr][]*agentConn{},
		cidrs:        map[netip.Prefix][]*agentConn{},
		nodes:        map[string][]*agentConn{},
	}
}

// agentSet is a list of agents with O(1) removal (the last takes the
// removed one's place), for the lists that may hold every agent.
type agentSet struct {
	list []*agentConn
	pos  map[*agentConn]int
}

func newAgentSet() agentSet { return agentSet{pos: map[*agentConn]int{}} }

func (s *agentSet) add(a *agentConn) {
	if _, ok := s.pos[a]; ok {
		return
	}
	s.pos[a] = len(s.list)
	s.list = append(s.list, a)
}

func (s *agentSet) remove(a *agentConn) {
	i, ok := s.pos[a]
	if !ok {
		return
	}
	last := len(s.list) - 1
	s.list[i] = s.list[last]
	s.pos[s.list[i]] = i
	s.list[last] = nil
	s.list = s.list[:last]
	delete(s.pos, a)
}

// hostKey is the form of a host name both the index and a dial's lookup
// use: in lower case (as ParseIdentifiers keeps host=), without a trailing
// dot.
func hostKey(h string) string { return strings.TrimSuffix(h, ".") }

// keys returns the distinct index keys of one agent, so that an identifier
// given twice is indexed once.
func (idx *agentIndex) keys(a *agentConn) (hosts []string, addrs []netip.Addr, cidrs []netip.Prefix) {
	for _, h := range a.ids.Hosts {
		if k := hostKey(h); !slices.Contains(hosts, k) {
			hosts = append(hosts, k)
		}
	}
	for _, ad := range a.ids.Addrs {
		if k := ad.Unmap(); !slices.Contains(addrs, k) {
			addrs = append(addrs, k)
		}
	}
	for _, p := range a.ids.CIDRs {
		if k := p.Masked(); k.IsValid() && !slices.Contains(cidrs, k) {
			cidrs = append(cidrs, k)
		}
	}
	return hosts, addrs, cidrs
}

func (idx *agentIndex) add(a *agentConn) {
	idx.all.add(a)
	if a.ids.DefaultRoute {
		idx.defaultRoute.add(a)
	}
	hosts, addrs, cidrs := idx.keys(a)
	for _, k := range hosts {
		idx.hosts[k] = append(idx.hosts[k], a)
	}
	for _, k := range addrs {
		idx.addrs[k] = append(idx.addrs[k], a)
	}
	for _, k := range cidrs {
		if len(idx.cidrs[k]) == 0 {
			idx.cidrBits(k.Addr())[k.Bits()]++
		}
		idx.cidrs[k] = append(idx.cidrs[k], a)
	}
	if a.node != "" {
		idx.nodes[a.node] = append(idx.nodes[a.node], a)
	}
}

func (idx *agentIndex) remove(a *agentConn) {
	if _, ok := idx.all.pos[a]; !ok {
		return
	}
	idx.all.remove(a)
	idx.defaultRoute.remove(a)
	hosts, addrs, cidrs := idx.keys(a)
	for _, k := range hosts {
		removeKeyed(idx.hosts, k, a)
	}
	for _, k := range addrs {
		removeKeyed(idx.addrs, k, a)
	}
	for _, k := range cidrs {
		if removeKeyed(idx.cidrs, k, a) {
			idx.cidrBits(k.Addr())[k.Bits()]--
		}
	}
	if a.node != "" {
		removeKeyed(idx.nodes, a.node, a)
	}
}

// cidrBits returns the per-length prefix counts of addr's family.
func (idx *agentIndex) cidrBits(addr netip.Addr) []int {
	if addr.Is4() {
		return idx.cidrBits4[:]
	}
	return idx.cidrBits6[:]
}

// removeKeyed takes a off m[k]'s list, and reports whether the list is gone.
func removeKeyed[K comparable](m map[K][]*agentConn, k K, a *agentConn) (emptied bool) {
	list := m[k]
	i := slices.Index(list, a)
	if i < 0 {
		return false
	}
	list = slices.Delete(list, i, i+1)
	if len(list) == 0 {
		delete(m, k)
		return true
	}
	m[k] = list
	return false
}

// chooseHost is the destHost strategy: an agent that names host exactly
// (host= or ipv4=/ipv6=) before one whose cidr= contains it, live before
// draining. A CIDR lookup costs one map probe per
// prefix length in use, not one per agent.
func (idx *agentIndex) chooseHost(c *chooser, host string) *agentConn {
	var exact []*agentConn
	var cidrLists [][]*agentConn
	if addr, err := parseHostAddr(host); err == nil {
		addr = addr.Unmap()
		exact = idx.addrs[addr]
		if addr.Zone() == "" { // netip.Prefix.Contains holds no zoned address
			bits := idx.cidrBits(addr)
			for n := len(bits) - 1; n >= 0; n-- {
				if bits[n] == 0 {
					continue
				}
				if p, err := addr.Prefix(n); err == nil {
					if list := idx.cidrs[p]; len(list) > 0 {
						cidrLists = append(cidrLists, list)
					}
				}
			}
		}
	} else {
		exact = idx.hosts[hostKey(strings.ToLower(host))]
	}
	liveExact, drainingExact := c.scan(exact)
	if liveExact != nil {
		return liveExact
	}
	liveCIDR, drainingCIDR := c.scan(cidrLists...)
	switch {
	case liveCIDR != nil:
		return liveCIDR
	case drainingExact != nil:
		return drainingExact
	}
	return drainingCIDR
}

// parseHostAddr parses host as an IP address, without netip.ParseAddr's
// error allocation for a host name that starts with a letter.
func parseHostAddr(host string) (netip.Addr, error) {
	if host != "" && !strings.Contains(host, ":") && (host[0] < '0' || host[0] > '9') {
		return netip.Addr{}, errNotAddr
	}
	return netip.ParseAddr(host)
}

var errNotAddr = errors.New("not an IP address")

// chooser is one dial's choice: which agents it may use and where in a
// list it starts, so successive dials rotate over equal agents.
type chooser struct {
	maxStreams int64
	exclude    map[*agentConn]bool // agents this dial already failed on
	turn       uint64              // the registry's rotation for this dial
}

// choose returns the first live usable agent of list from the turn's place
// on, else the first usable draining one, else nil.
func (c *chooser) choose(list []*agentConn) *agentConn {
	live, draining := c.scan(list)
	if live != nil {
		return live
	}
	return draining
}

// scan walks the lists as one, from the turn's place on, and returns the
// first usable live agent and the first usable draining one met before
// it. It stops at the first live one: while most agents take tunnels, it
// visits one or a few agents whatever the number of agents.
func (c *chooser) scan(lists ...[]*agentConn) (live, draining *agentConn) {
	total := 0
	for _, l := range lists {
		total += len(l)
	}
	if total == 0 {
		return nil, nil
	}
	start := int(c.turn % uint64(total))
	li, off := 0, start
	for off >= len(lists[li]) {
		off -= len(lists[li])
		li++
	}
	for range total {
		a := lists[li][off]
		if off++; off == len(lists[li]) {
			off = 0
			for {
				li = (li + 1) % len(lists)
				if len(lists[li]) > 0 {
					break
				}
			}
		}
		if c.exclude[a] || !a.usable(c.maxStreams) {
			continue
		}
		if !a.draining.Load() {
			return a, draining
		}
		if draining == nil {
			draining = a
		}
	}
	return nil, draining
}
