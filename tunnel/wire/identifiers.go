package wire

import (
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
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
	// Ignored lists the values that name nothing a dial can match, one
	// "key=value: why" each, in the order given. They are dropped, not
	// refused: upstream checks keys only, so its manifests carry values
	// such as an unexpanded ${HOST_IP} and still start.
	Ignored []string
}

// maxIdentifiersLen bounds what an agent may send, so a hostile agent cannot
// make the server hold a large routing table for it.
const maxIdentifiersLen = 8 << 10

// identifierKeys are the keys upstream's agent accepts.
var identifierKeys = []string{"host", "ipv4", "ipv6", "cidr", "default-route"}

// ParseIdentifiers parses upstream's --agent-identifiers syntax. Bad query
// syntax and unknown keys are errors, as upstream's agent refuses them; a
// value that cannot be used is dropped and listed in Ignored.
func ParseIdentifiers(s string) (Identifiers, error) { return parseIdentifiers(s, true) }

// ParseFromAgent reads the identifiers an agent sent as upstream's server
// does: an unknown key is dropped (listed in Ignored) rather than refused,
// so an agent newer than the server, with a key the server does not know,
// still connects.
func ParseFromAgent(s string) (Identifiers, error) { return parseIdentifiers(s, false) }

func parseIdentifiers(s string, strictKeys bool) (Identifiers, error) {
	var ids Identifiers
	if len(s) > maxIdentifiersLen {
		return ids, fmt.Errorf("agent identifiers: %d bytes, more than the %d allowed", len(s), maxIdentifiersLen)
	}
	if strings.TrimSpace(s) == "" {
		return ids, nil
	}
	// Pairs in the order given (url.ParseQuery's map loses it), so that
	// Ignored reads like the flag.
	for pair := range strings.SplitSeq(s, "&") {
		if pair == "" {
			continue
		}
		rawKey, rawValue, _ := strings.Cut(pair, "=")
		key, err := url.QueryUnescape(rawKey)
		if err != nil {
			return Identifiers{}, fmt.Errorf("agent identifiers %q: %w", s, err)
		}
		value, err := url.QueryUnescape(rawValue)
		if err != nil {
			return Identifiers{}, fmt.Errorf("agent identifiers %q: %w", s, err)
		}
		if !slices.Contains(identifierKeys, key) {
			if !strictKeys {
				ids.Ignored = append(ids.Ignored, fmt.Sprintf("%s=%s: unknown key", key, value))
				continue
			}
			return Identifiers{}, fmt.Errorf("agent identifiers: unknown identifier %q (want host, ipv4, ipv6, cidr or default-route)", key)
		}
		if why := ids.add(key, value); why != "" {
			ids.Ignored = append(ids.Ignored, fmt.Sprintf("%s=%s: %s", key, value, why))
		}
	}
	return ids, nil
}

// add records one value of a known key, or says why it cannot be used.
func (ids *Identifiers) add(key, value string) (why string) {
	if value == "" {
		if key == "default-route" {
			return "empty value, read as false (as upstream does)"
		}
		return "empty value"
	}
	if strings.Contains(value, "${") || strings.Contains(value, "$(") {
		return "an unexpanded variable (Kubernetes expands only $(VAR) in args, and only for variables the container defines)"
	}
	switch key {
	case "host":
		if strings.ContainsAny(value, " \t/") {
			return "not a host name"
		}
		ids.Hosts = append(ids.Hosts, strings.ToLower(value))
	case "ipv4", "ipv6":
		addr, err := netip.ParseAddr(value)
		if err != nil {
			return "not an IP address"
		}
		if (key == "ipv4") != addr.Is4() {
			return "wrong address family"
		}
		ids.Addrs = append(ids.Addrs, addr)
	case "cidr":
		prefix, err := netip.ParsePrefix(value)
		if err != nil {
			return "not a CIDR prefix"
		}
		ids.CIDRs = append(ids.CIDRs, prefix.Masked())
	case "default-route":
		// strconv.ParseBool, as upstream reads it.
		b, err := strconv.ParseBool(value)
		if err != nil {
			return "not true or false"
		}
		ids.DefaultRoute = ids.DefaultRoute || b
	}
	return ""
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

// SplitDialAddress validates a CONNECT target: host:port with a numeric port
// in 1..65535 and a non-empty host.
func SplitDialAddress(addr string) (host string, err error) {
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
