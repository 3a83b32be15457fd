package tunnel

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// DestinationPolicy says which destinations an agent may dial. Deny rules
// win over allow rules; with allow rules, everything else is denied. The
// cloud metadata addresses are denied unless an allow rule names them.
type DestinationPolicy struct {
	allow, deny []destRule
}

type destRule struct {
	text     string
	prefix   netip.Prefix // invalid means any address
	portLo   int          // 0 means any port
	portHi   int
	metadata bool // one of the built-in metadata denials
}

// Instance metadata services hand out cloud credentials: reaching them
// through the tunnel would turn egress into a credential leak.
var metadataPrefixes = []string{"169.254.169.254/32", "fd00:ec2::254/128"}

// NewDestinationPolicy parses comma lists of rules such as "10.0.0.0/8",
// "10.0.0.5", "10.0.0.0/8:443", "[fd00::/8]:8000-9000" or ":10250".
func NewDestinationPolicy(allow, deny string) (*DestinationPolicy, error) {
	p := &DestinationPolicy{}
	var err error
	if p.allow, err = parseDestRules(allow); err != nil {
		return nil, fmt.Errorf("allowed destinations: %w", err)
	}
	if p.deny, err = parseDestRules(deny); err != nil {
		return nil, fmt.Errorf("denied destinations: %w", err)
	}
	for _, m := range metadataPrefixes {
		p.deny = append(p.deny, destRule{text: m + " (cloud metadata; allow it explicitly to reach it)", prefix: netip.MustParsePrefix(m), metadata: true})
	}
	return p, nil
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
		if strings.Contains(addr, "/") {
			p, err := netip.ParsePrefix(addr)
			if err != nil {
				return r, fmt.Errorf("rule %q: %w", s, err)
			}
			r.prefix = p.Masked()
		} else {
			a, err := netip.ParseAddr(addr)
			if err != nil {
				return r, fmt.Errorf("rule %q: %w", s, err)
			}
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

func parsePort(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 {
		return 0, fmt.Errorf("port %q: want 1-65535", s)
	}
	return n, nil
}

func (r destRule) matches(ip netip.Addr, port int) bool {
	if r.prefix.IsValid() && !r.prefix.Contains(ip.Unmap()) {
		return false
	}
	return r.portLo == 0 || (port >= r.portLo && port <= r.portHi)
}

// Check returns nil when ip:port may be dialled, else the reason it may not.
func (p *DestinationPolicy) Check(ip netip.Addr, port int) error {
	if p == nil {
		return nil
	}
	ip = ip.Unmap()
	explicitlyAllowed := false
	for _, r := range p.allow {
		if r.matches(ip, port) {
			explicitlyAllowed = true
			break
		}
	}
	for _, r := range p.deny {
		if r.matches(ip, port) && !(r.metadata && explicitlyAllowed && allowNames(p.allow, ip)) {
			return fmt.Errorf("destination %s denied by rule %s", netip.AddrPortFrom(ip, uint16(port)), r.text)
		}
	}
	if len(p.allow) > 0 && !explicitlyAllowed {
		return fmt.Errorf("destination %s is not in the allowed destinations", netip.AddrPortFrom(ip, uint16(port)))
	}
	return nil
}

// allowNames reports whether an allow rule names ip specifically (not just
// a wide range that happens to contain a metadata address).
func allowNames(allow []destRule, ip netip.Addr) bool {
	for _, r := range allow {
		if r.prefix.IsValid() && r.prefix.Contains(ip) && r.prefix.Bits() >= ip.BitLen()-8 {
			return true
		}
	}
	return false
}
