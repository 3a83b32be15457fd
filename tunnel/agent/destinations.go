package agent

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// DestinationPolicy says which destinations an agent may dial. Each address
// is checked in this order, and the first step that decides wins:
//
//  1. a zoned IPv6 address (fe80::1%eth0) is refused: the zone picks a
//     network interface of the agent's host, and no rule can check that;
//  2. a Deny rule that matches refuses it;
//  3. a built-in rule (link-local ranges, cloud metadata services) refuses
//     it, unless an Open rule matches;
//  4. with Allow rules, an address none of them matches is refused; the
//     Allow keyword "node" matches loopback and the addresses of the
//     agent's own node as the apiserver says (its addresses, pod CIDRs and
//     pods: DestinationRules.Owns);
//  5. anything else is allowed.
//
// Addresses are checked as they are dialled: an IPv4-mapped IPv6 address
// as its IPv4 address, and an unspecified address (0.0.0.0, ::), which the
// kernel connects to the local host, as the loopback address it reaches.
// A Deny rule that covers either loopback address (127.0.0.1 or ::1) also
// refuses both unspecified addresses.
//
// A policy is not changed once made, so any number of dials may check it
// at once.
type DestinationPolicy struct {
	allow, deny, open []destRule
	ownNode           string                // the agent's node, with the "node" keyword; "" without
	owns              func(netip.Addr) bool // whether an address is ownNode's; safe for concurrent use
}

// DestinationRules are the operator's comma lists of rules, each rule
// such as "10.0.0.0/8", "10.0.0.5", "10.0.0.0/8:443", "[fd00::/8]:8000-9000"
// or ":10250" (any address, one port).
type DestinationRules struct {
	Allow string // when set, the only destinations that may be dialled
	Deny  string // never dialled; wins over everything else
	Open  string // parts of the built-in denied ranges that may be dialled

	// OwnNode is the agent's node and Owns says whether an address is one
	// of its addresses, inside its pod CIDRs, or a pod the apiserver
	// places on it. Both are needed when Allow holds the keyword "node".
	OwnNode string
	Owns    func(netip.Addr) bool
}

// nodeKeyword in an Allow list allows loopback and the agent's own node.
const nodeKeyword = "node"

// HasNodeRule reports whether an Allow list holds the keyword "node".
func HasNodeRule(allow string) bool {
	_, found := withoutNodeKeyword(allow)
	return found
}

func withoutNodeKeyword(allow string) (rest string, found bool) {
	var others []string
	for _, item := range strings.Split(allow, ",") {
		if strings.TrimSpace(item) == nodeKeyword {
			found = true
			continue
		}
		others = append(others, item)
	}
	return strings.Join(others, ","), found
}

type destRule struct {
	text   string
	prefix netip.Prefix // invalid means any address
	portLo int          // 0 means any port
	portHi int
}

// builtinDenied are refused unless an Open rule names them. Instance
// metadata and credential services give out cloud credentials: reaching
// them through the tunnel would turn egress into a credential leak. The
// link-local ranges hold most of them (AWS, GCE, Azure, OpenStack and
// Oracle metadata at 169.254.169.254, ECS task metadata at 169.254.170.2,
// EKS Pod Identity at 169.254.170.23) and nothing a kube-apiserver dials.
// The reasons are short: a refusal's text travels back to the client.
var builtinDenied = []struct{ prefix, why string }{
	{"169.254.0.0/16", "IPv4 link-local, cloud metadata"},
	{"fe80::/10", "IPv6 link-local"},
	{"fd00:ec2::254/128", "AWS metadata, IPv6"},
	{"fd00:ec2::23/128", "EKS Pod Identity, IPv6"},
	{"100.100.100.200/32", "Alibaba Cloud metadata"},
	{"168.63.129.16/32", "Azure WireServer"},
}

// builtinRules is builtinDenied parsed once; it is never modified.
var builtinRules = func() []destRule {
	rules := make([]destRule, len(builtinDenied))
	for i, b := range builtinDenied {
		rules[i] = destRule{text: b.prefix + " (" + b.why + ")", prefix: netip.MustParsePrefix(b.prefix)}
	}
	return rules
}()

var (
	loopback4 = netip.AddrFrom4([4]byte{127, 0, 0, 1})
	loopback6 = netip.IPv6Loopback()
)

// NewDestinationPolicy parses the operator's rules.
func NewDestinationPolicy(r DestinationRules) (*DestinationPolicy, error) {
	p := &DestinationPolicy{}
	allow, ownNode := withoutNodeKeyword(r.Allow)
	if ownNode {
		if r.OwnNode == "" || r.Owns == nil {
			return nil, errors.New("allowed destinations: the rule \"node\" needs the agent's node name and its view of the node")
		}
		p.ownNode, p.owns = r.OwnNode, r.Owns
	}
	var err error
	if p.allow, err = parseDestRules(allow); err != nil {
		return nil, fmt.Errorf("allowed destinations: %w", err)
	}
	if p.deny, err = parseDestRules(r.Deny); err != nil {
		return nil, fmt.Errorf("denied destinations: %w", err)
	}
	if p.open, err = parseDestRules(r.Open); err != nil {
		return nil, fmt.Errorf("opened destinations: %w", err)
	}
	for _, o := range p.open {
		if !o.prefix.IsValid() {
			return nil, fmt.Errorf("opened destinations: rule %q must name addresses", o.text)
		}
		overlaps := false
		for _, b := range builtinRules {
			overlaps = overlaps || o.prefix.Overlaps(b.prefix)
		}
		if !overlaps {
			return nil, fmt.Errorf("opened destinations: rule %q opens nothing: it is outside the built-in denied ranges (%s)", o.text, builtinPrefixes())
		}
	}
	return p, nil
}

func builtinPrefixes() string {
	s := make([]string, len(builtinDenied))
	for i, b := range builtinDenied {
		s[i] = b.prefix
	}
	return strings.Join(s, ", ")
}

func parseDestRules(list string) ([]destRule, error) {
	var rules []destRule
	for _, item := range strings.Split(list, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		r, err := parseDestRule(item)
		if err != nil {
			return nil, err
		}
		rules = append(rules, r)
	}
	return rules, nil
}

func parseDestRule(s string) (destRule, error) {
	r := destRule{text: s}
	addr, ports := s, ""
	switch {
	case strings.HasPrefix(s, "["):
		end := strings.Index(s, "]")
		if end < 0 {
			return r, fmt.Errorf("rule %q: missing ]", s)
		}
		addr = s[1:end]
		if rest := s[end+1:]; rest != "" {
			if !strings.HasPrefix(rest, ":") {
				return r, fmt.Errorf("rule %q: want [prefix]:port", s)
			}
			ports = rest[1:]
		}
	case strings.Count(s, ":") == 1:
		addr, ports, _ = strings.Cut(s, ":")
	}
	if addr != "" && addr != "*" {
		if strings.Contains(addr, "%") {
			return r, fmt.Errorf("rule %q: zoned addresses are always refused, a rule cannot name one", s)
		}
		if strings.Contains(addr, "/") {
			p, err := netip.ParsePrefix(addr)
			if err != nil {
				return r, fmt.Errorf("rule %q: %w", s, err)
			}
			r.prefix = unmapPrefix(p.Masked())
		} else {
			a, err := netip.ParseAddr(addr)
			if err != nil {
				return r, fmt.Errorf("rule %q: %w", s, err)
			}
			a = a.Unmap()
			r.prefix = netip.PrefixFrom(a, a.BitLen())
		}
	}
	if ports != "" {
		lo, hi, isRange := strings.Cut(ports, "-")
		var err error
		if r.portLo, err = parsePort(lo); err != nil {
			return r, fmt.Errorf("rule %q: %w", s, err)
		}
		r.portHi = r.portLo
		if isRange {
			if r.portHi, err = parsePort(hi); err != nil || r.portHi < r.portLo {
				return r, fmt.Errorf("rule %q: bad port range", s)
			}
		}
	}
	if !r.prefix.IsValid() && r.portLo == 0 {
		return r, fmt.Errorf("rule %q: names neither an address nor a port", s)
	}
	return r, nil
}

// unmapPrefix turns a prefix of IPv4-mapped addresses (::ffff:10.0.0.0/104)
// into the IPv4 prefix it covers, since addresses are checked unmapped.
func unmapPrefix(p netip.Prefix) netip.Prefix {
	if a := p.Addr(); a.Is4In6() && p.Bits() >= 96 {
		return netip.PrefixFrom(a.Unmap(), p.Bits()-96)
	}
	return p
}

func parsePort(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 {
		return 0, fmt.Errorf("port %q: want 1-65535", s)
	}
	return n, nil
}

func (r destRule) matches(ip netip.Addr, port int) bool {
	if r.prefix.IsValid() && !r.prefix.Contains(ip) {
		return false
	}
	return r.portLo == 0 || (port >= r.portLo && port <= r.portHi)
}

// dialAddr is the address a dial of ip reaches, the one the policy checks:
// IPv4-mapped addresses unmapped, an unspecified address as the loopback
// address of its family (what Linux connects it to). A zone stays, so a
// zoned address stays visible to Check.
func dialAddr(ip netip.Addr) netip.Addr {
	if ip.Zone() == "" {
		ip = ip.Unmap()
	}
	if ip.IsUnspecified() {
		if ip.Is4() {
			return loopback4
		}
		return loopback6
	}
	return ip
}

// Check returns nil when ip:port may be dialled, else the reason it may
// not. The address that may be dialled is dialAddr(ip). A nil policy
// allows everything; an agent always has one (see Config.Destinations).
func (p *DestinationPolicy) Check(ip netip.Addr, port int) error {
	if p == nil {
		return nil
	}
	if !ip.IsValid() {
		return fmt.Errorf("destination has no valid address")
	}
	if ip.Zone() != "" {
		return fmt.Errorf("destination %s refused: a zoned address names a network interface of the agent's host, which no rule can check", netip.AddrPortFrom(ip, uint16(port)))
	}
	asked := ip.Unmap()
	ip = dialAddr(asked)
	local := asked.IsUnspecified()
	for _, r := range p.deny {
		if r.matches(ip, port) || local && (r.matches(asked, port) || r.matches(loopback4, port) || r.matches(loopback6, port)) {
			return fmt.Errorf("destination %s denied by rule %s (--deny-destinations)", describeDest(asked, ip, port), r.text)
		}
	}
	for _, r := range builtinRules {
		if r.matches(ip, port) && !matchesAny(p.open, ip, port) {
			return fmt.Errorf("destination %s denied by the built-in rule %s; --open-destinations opens it", describeDest(asked, ip, port), r.text)
		}
	}
	if (len(p.allow) > 0 || p.owns != nil) && !matchesAny(p.allow, ip, port) && !p.ownNodeHas(ip) {
		if p.owns != nil {
			return fmt.Errorf("destination %s is not in the allowed destinations (--allow-destinations): not loopback, nor an address, pod CIDR or pod of this agent's node %q as the apiserver lists them", describeDest(asked, ip, port), p.ownNode)
		}
		return fmt.Errorf("destination %s is not in the allowed destinations (--allow-destinations)", describeDest(asked, ip, port))
	}
	return nil
}

// ownNodeHas reports whether the "node" rule allows ip: loopback, or an
// address of the agent's own node.
func (p *DestinationPolicy) ownNodeHas(ip netip.Addr) bool {
	return p.owns != nil && (ip.IsLoopback() || p.owns(ip))
}

func matchesAny(rules []destRule, ip netip.Addr, port int) bool {
	for _, r := range rules {
		if r.matches(ip, port) {
			return true
		}
	}
	return false
}

// describeDest names the destination as asked and, when it differs, as
// dialled ("0.0.0.0:80 (the agent's host, dialled as 127.0.0.1)").
func describeDest(asked, dialled netip.Addr, port int) string {
	s := netip.AddrPortFrom(asked, uint16(port)).String()
	if asked != dialled {
		s += " (the agent's host, dialled as " + dialled.String() + ")"
	}
	return s
}
