package wire

import (
	"slices"
	"strings"
	"testing"
)

// TestParseIdentifiersKeysOnly: as upstream, keys are checked and values are
// not refused; a value that names nothing is dropped and reported.
func TestParseIdentifiersKeysOnly(t *testing.T) {
	for _, tc := range []struct {
		in           string
		hosts        []string
		addrs        []string
		cidrs        []string
		defaultRoute bool
		ignored      []string // prefixes of the Ignored entries, in order
	}{
		// upstream's kind-multinode and e2e agents: Kubernetes does not expand ${...}
		{in: "ipv4=${HOST_IP}", ignored: []string{"ipv4=${HOST_IP}: an unexpanded variable"}},
		// $(HOST_IP) is left as is when the container defines no HOST_IP
		{in: "ipv4=$(HOST_IP)", ignored: []string{"ipv4=$(HOST_IP): an unexpanded variable"}},
		{in: "ipv4=", ignored: []string{"ipv4=: empty value"}},
		{in: "default-route", ignored: []string{"default-route=: empty value"}},
		// upstream's own --agent-identifiers help example
		{
			in:           "host=localhost&host=node1.mydomain.com&cidr=127.0.0.1/16&ipv4=1.2.3.4&ipv4=5.6.7.8&ipv6=:::::&default-route=true",
			hosts:        []string{"localhost", "node1.mydomain.com"},
			addrs:        []string{"1.2.3.4", "5.6.7.8"},
			cidrs:        []string{"127.0.0.0/16"},
			defaultRoute: true,
			ignored:      []string{"ipv6=:::::: not an IP address"},
		},
		{in: "ipv4=fd00::1&ipv6=10.0.0.1", ignored: []string{"ipv4=fd00::1: wrong address family", "ipv6=10.0.0.1: wrong address family"}},
		{in: "cidr=10.0.0.0/33&host=a%20b", ignored: []string{"cidr=10.0.0.0/33: not a CIDR", "host=a b: not a host name"}},
		{in: "default-route=1", defaultRoute: true},
		{in: "default-route=maybe", ignored: []string{"default-route=maybe: not true or false"}},
		{in: "host=Node1&ipv4=10.0.0.5", hosts: []string{"node1"}, addrs: []string{"10.0.0.5"}},
	} {
		ids, err := ParseIdentifiers(tc.in)
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		var addrs, cidrs []string
		for _, a := range ids.Addrs {
			addrs = append(addrs, a.String())
		}
		for _, p := range ids.CIDRs {
			cidrs = append(cidrs, p.String())
		}
		if !slices.Equal(ids.Hosts, tc.hosts) || !slices.Equal(addrs, tc.addrs) || !slices.Equal(cidrs, tc.cidrs) || ids.DefaultRoute != tc.defaultRoute {
			t.Errorf("%q: got hosts %v addrs %v cidrs %v default-route %v", tc.in, ids.Hosts, addrs, cidrs, ids.DefaultRoute)
		}
		if len(ids.Ignored) != len(tc.ignored) {
			t.Errorf("%q: ignored %q, want %q", tc.in, ids.Ignored, tc.ignored)
			continue
		}
		for i, want := range tc.ignored {
			if !strings.HasPrefix(ids.Ignored[i], want) {
				t.Errorf("%q: ignored[%d] = %q, want prefix %q", tc.in, i, ids.Ignored[i], want)
			}
		}
	}
	// A dropped value matches nothing.
	ids, _ := ParseIdentifiers("ipv4=${HOST_IP}&host=n1")
	if !slices.Equal(ids.Hosts, []string{"n1"}) || len(ids.Addrs) != 0 || len(ids.CIDRs) != 0 {
		t.Errorf("matching after a dropped value is wrong: %+v", ids)
	}
}

// TestParseIdentifiersRefuses: what upstream's agent refuses is refused.
func TestParseIdentifiersRefuses(t *testing.T) {
	for _, in := range []string{"unknown=1", "host=%zz", "%zz=1", "ipv4=1.2.3.4&zone=a", strings.Repeat("h", maxIdentifiersLen+1)} {
		if _, err := ParseIdentifiers(in); err == nil {
			t.Errorf("%q: accepted", in)
		}
	}
}

// TestParseFromAgent: the server, as upstream's, drops what it does not
// know instead of refusing the agent; bad syntax and size are still refused.
func TestParseFromAgent(t *testing.T) {
	ids, err := ParseFromAgent("host=n1&zone=a&ipv4=${HOST_IP}")
	if err != nil || !slices.Equal(ids.Hosts, []string{"n1"}) || len(ids.Ignored) != 2 {
		t.Errorf("got %+v, %v", ids, err)
	}
	for _, in := range []string{"host=%zz", strings.Repeat("h", maxIdentifiersLen+1)} {
		if _, err := ParseFromAgent(in); err == nil {
			t.Errorf("%q: accepted", in)
		}
	}
}
