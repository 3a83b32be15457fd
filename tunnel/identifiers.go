package tunnel

import (
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"strings"
)

// Identifiers are the names an agent answers to when the server routes a dial
// by destination. They use upstream's URL-query syntax, for example
// "host=node1&ipv4=10.0.0.5&cidr=10.42.0.0/24&default-route=true".
type Identifiers struct {
	Hosts        []string
	Addrs        []netip.Addr // ipv4= and ipv6= values
	CIDRs        []netip.Prefix
	DefaultRoute bool
}

// maxIdentifiersLen bounds what an agent may send, so a hostile agent cannot
// make the server hold a large routing table for it.
const maxIdentifiersLen = 8 << 10

// ParseIdentifiers parses upstream's --agent-identifiers syntax. Unknown keys
// and malformed values are errors, as upstream's agent rejects them too.
func ParseIdentifiers(s string) (Identifiers, error) {
	var ids Identifiers
	if len(s) > maxIdentifiersLen {
		return ids, fmt.Errorf("agent identifiers: %d bytes, more than the %d allowed", len(s), maxIdentifiersLen)
	}
	if strings.TrimSpace(s) == "" {
		return ids, nil
	}
	values, err := url.ParseQuery(s)
	if err != nil {
		return ids, fmt.Errorf("agent identifiers %q: %w", s, err)
	}
	for key, vals := range values {
		for _, v := range vals {
			if err := ids.add(key, v); err != nil {
				return Identifiers{}, fmt.Errorf("agent identifiers: %w", err)
			}
		}
	}
	return ids, nil
}

func (ids *Identifiers) add(key, value string) error {
	switch key {
	case "host":
		if value == "" || strings.ContainsAny(value, " \t/") {
			return fmt.Errorf("host=%q: not a host name", value)
		}
		ids.Hosts = append(ids.Hosts, strings.ToLower(value))
	case "ipv4", "ipv6":
		addr, err := netip.ParseAddr(value)
		if err != nil {
			return fmt.Errorf("%s=%q: %w", key, value, err)
		}
		if (key == "ipv4") != addr.Is4() {
			return fmt.Errorf("%s=%q: wrong address family", key, value)
		}
		ids.Addrs = append(ids.Addrs, addr)
	case "cidr":
		prefix, err := netip.ParsePrefix(value)
		if err != nil {
			return fmt.Errorf("cidr=%q: %w", value, err)
		}
		ids.CIDRs = append(ids.CIDRs, prefix.Masked())
	case "default-route":
		switch strings.ToLower(value) {
		case "true", "":
			ids.DefaultRoute = true
		case "false":
		default:
			return fmt.Errorf("default-route=%q: want true or false", value)
		}
	default:
		return fmt.Errorf("unknown identifier %q (want host, ipv4, ipv6, cidr or default-route)", key)
	}
	return nil
}

// String renders the identifiers back into the query syntax.
func (ids Identifiers) String() string {
	v := url.Values{}
	for _, h := range ids.Hosts {
		v.Add("host", h)
	}
	for _, a := range ids.Addrs {
		if a.Is4() {
			v.Add("ipv4", a.String())
		} else {
			v.Add("ipv6", a.String())
		}
	}
	for _, p := range ids.CIDRs {
		v.Add("cidr", p.String())
	}
	if ids.DefaultRoute {
		v.Add("default-route", "true")
	}
	return v.Encode()
}

// destMatch says how well these identifiers name the host part of a dial
// address: an exact host or address beats a CIDR that contains the address.
type destMatch int

const (
	noMatch destMatch = iota
	cidrMatch
	exactMatch
)

func (ids Identifiers) matchHost(host string) destMatch {
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

// splitDialAddress validates a CONNECT target: host:port with a numeric port
// in 1..65535 and a non-empty host.
func splitDialAddress(addr string) (host string, err error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("dial address %q: %w", addr, err)
	}
	if host == "" {
		return "", fmt.Errorf("dial address %q: empty host", addr)
	}
	if strings.ContainsAny(host, " \t\r\n/@") {
		return "", fmt.Errorf("dial address %q: invalid host", addr)
	}
	n := 0
	for _, c := range port {
		if c < '0' || c > '9' || n > 65535 {
			return "", fmt.Errorf("dial address %q: invalid port", addr)
		}
		n = n*10 + int(c-'0')
	}
	if n < 1 || n > 65535 {
		return "", fmt.Errorf("dial address %q: port out of range", addr)
	}
	return host, nil
}
