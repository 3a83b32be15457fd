package nodemap

import (
	"encoding/json"
	"errors"
	"net/netip"
	"strings"
	"testing"

	"github.com/spinifex/konnectivity/internal/kubeapi"
)

func node(name string, addrs []string, cidrs ...string) *kubeapi.Node {
	n := &kubeapi.Node{Name: name}
	for _, a := range addrs {
		if ip, err := netip.ParseAddr(a); err == nil {
			n.Addresses = append(n.Addresses, ip)
		} else {
			n.Hostnames = append(n.Hostnames, a)
		}
	}
	for _, c := range cidrs {
		n.PodCIDRs = append(n.PodCIDRs, netip.MustParsePrefix(c).Masked())
	}
	return n
}

func claims(node string, addrs ...string) []claim {
	var cs []claim
	for _, a := range addrs {
		cs = append(cs, claim{addr: netip.MustParseAddr(a), node: node})
	}
	return cs
}

type lookupCase struct {
	host  string
	node  string
	match Match
}

func checkLookups(t *testing.T, tb *Table, cases []lookupCase) {
	t.Helper()
	for _, c := range cases {
		node, m := tb.Lookup(c.host)
		if node != c.node || m != c.match {
			t.Errorf("Lookup(%q) = %q, %v; want %q, %v", c.host, node, m, c.node, c.match)
		}
	}
}

func TestTableLongestPrefix(t *testing.T) {
	tb := NewTable()
	tb.setNode(node("wide", nil, "10.0.0.0/8"))
	tb.setNode(node("narrow", nil, "10.1.0.0/16"))
	tb.setNode(node("narrowest", nil, "10.1.2.0/24"))
	checkLookups(t, tb, []lookupCase{
		{"10.9.9.9", "wide", PodCIDR},
		{"10.1.9.9", "narrow", PodCIDR},
		{"10.1.2.3", "narrowest", PodCIDR},
		{"10.1.2.255", "narrowest", PodCIDR},
		{"11.0.0.1", "", NoMatch},
	})
	tb.deleteNode("narrowest")
	checkLookups(t, tb, []lookupCase{{"10.1.2.3", "narrow", PodCIDR}})
}

func TestTableIPv4AndIPv6(t *testing.T) {
	tb := NewTable()
	tb.setNode(node("a", []string{"192.168.1.10", "fd00::10", "node-a.example"}, "10.244.0.0/24"))
	tb.setNode(node("b", []string{"192.168.1.11", "fd00::11"}, "fd10:244:1::/64"))
	checkLookups(t, tb, []lookupCase{
		{"192.168.1.10", "a", NodeAddress},
		{"[fd00::10]", "a", NodeAddress},
		{"fd00::11", "b", NodeAddress},
		{"::ffff:192.168.1.11", "b", NodeAddress}, // IPv4-mapped is the IPv4 address
		{"Node-A.example.", "a", NodeAddress},
		{"10.244.0.7", "a", PodCIDR},
		{"fd10:244:1::7", "b", PodCIDR},
		{"fd10:244:2::7", "", NoMatch},
		{"fe80::1%eth0", "", NoMatch},
		{"node-b.example", "", NoMatch},
	})
}

func TestTableDualStackPodCIDRs(t *testing.T) {
	tb := NewTable()
	tb.setNode(node("a", nil, "10.244.0.0/24", "fd10:244::/64"))
	tb.setNode(node("b", nil, "10.244.1.0/24", "fd10:244:0:1::/64"))
	checkLookups(t, tb, []lookupCase{
		{"10.244.0.9", "a", PodCIDR},
		{"fd10:244::9", "a", PodCIDR},
		{"10.244.1.9", "b", PodCIDR},
		{"fd10:244:0:1::9", "b", PodCIDR},
	})
}

// A CNI that gives pods addresses outside the Nodes' podCIDRs (AWS VPC CNI)
// is routed by the EndpointSlices that name the pods.
func TestTablePodOutsideCIDRFromSlice(t *testing.T) {
	tb := NewTable()
	tb.setNode(node("a", []string{"172.31.0.10"}, "10.244.0.0/24"))
	tb.setNode(node("b", []string{"172.31.0.11"}, "10.244.1.0/24"))
	tb.setClaims(fromSlices, "ns/web-x1", claims("b", "172.31.5.5", "10.244.0.99"))
	checkLookups(t, tb, []lookupCase{
		{"172.31.5.5", "b", PodAddress},
		// A pod address beats a pod CIDR: the API says the pod runs on b.
		{"10.244.0.99", "b", PodAddress},
		{"172.31.0.11", "b", NodeAddress},
	})
	// The same address in a second slice (a pod behind two Services)
	// stays until both drop it.
	tb.setClaims(fromSlices, "ns/api-y2", claims("b", "172.31.5.5"))
	tb.dropClaims(fromSlices, "ns/web-x1")
	checkLookups(t, tb, []lookupCase{
		{"172.31.5.5", "b", PodAddress},
		{"10.244.0.99", "a", PodCIDR},
	})
	// An update replaces what the slice placed.
	tb.setClaims(fromSlices, "ns/api-y2", claims("a", "172.31.6.6"))
	checkLookups(t, tb, []lookupCase{
		{"172.31.5.5", "", NoMatch},
		{"172.31.6.6", "a", PodAddress},
	})
	if _, pods := tb.Size(); pods != 1 {
		t.Fatalf("pod addresses = %d, want 1", pods)
	}
}

// An address reused by a pod on another node belongs to the newer claim,
// and returns to the older one when the newer goes.
func TestTablePodAddressMoves(t *testing.T) {
	tb := NewTable()
	tb.setNode(node("a", nil))
	tb.setNode(node("b", nil))
	tb.setClaims(fromSlices, "ns/old", claims("a", "10.0.0.5"))
	tb.setClaims(fromPods, "ns/new", claims("b", "10.0.0.5"))
	checkLookups(t, tb, []lookupCase{{"10.0.0.5", "b", PodAddress}})
	tb.dropClaims(fromPods, "ns/new")
	checkLookups(t, tb, []lookupCase{{"10.0.0.5", "a", PodAddress}})
	tb.dropClaims(fromSlices, "ns/old")
	checkLookups(t, tb, []lookupCase{{"10.0.0.5", "", NoMatch}})
	if _, pods := tb.Size(); pods != 0 {
		t.Fatalf("pod addresses = %d, want 0", pods)
	}
}

func TestTableNodeDeletedDropsRoutes(t *testing.T) {
	tb := NewTable()
	tb.setNode(node("a", []string{"192.168.1.10", "host-a"}, "10.244.0.0/24", "fd10::/64"))
	tb.setClaims(fromSlices, "ns/s", claims("a", "172.31.5.5"))
	tb.deleteNode("a")
	for _, h := range []string{"192.168.1.10", "host-a", "10.244.0.1", "fd10::1", "172.31.5.5"} {
		if n, m := tb.Lookup(h); m != NoMatch {
			t.Errorf("after delete, Lookup(%q) = %q, %v", h, n, m)
		}
	}
	if len(tb.lens[0])+len(tb.lens[1]) != 0 {
		t.Errorf("prefix lengths left after delete: %v", tb.lens)
	}
}

func TestTableCIDRChangeFollowed(t *testing.T) {
	tb := NewTable()
	tb.setNode(node("a", []string{"192.168.1.10"}, "10.244.0.0/24"))
	tb.setNode(node("a", []string{"192.168.1.20"}, "10.245.0.0/16"))
	checkLookups(t, tb, []lookupCase{
		{"10.244.0.1", "", NoMatch},
		{"10.245.3.1", "a", PodCIDR},
		{"192.168.1.10", "", NoMatch},
		{"192.168.1.20", "a", NodeAddress},
	})
}

// Two nodes claiming one address (a shared NAT ExternalIP, overlapping
// CIDRs) route neither: the table never guesses.
func TestTableAmbiguousRoutesNowhere(t *testing.T) {
	tb := NewTable()
	tb.setNode(node("a", []string{"203.0.113.1", "192.168.1.10"}, "10.244.0.0/16"))
	tb.setNode(node("b", []string{"203.0.113.1", "192.168.1.11"}, "10.244.0.0/16"))
	tb.setNode(node("c", nil, "10.0.0.0/8"))
	checkLookups(t, tb, []lookupCase{
		{"203.0.113.1", "", NoMatch},
		{"192.168.1.11", "b", NodeAddress},
		{"10.244.1.1", "", NoMatch}, // not c's: a longer prefix is ambiguous
	})
	tb.deleteNode("b")
	checkLookups(t, tb, []lookupCase{
		{"203.0.113.1", "a", NodeAddress},
		{"10.244.1.1", "a", PodCIDR},
	})
}

// A list item or watch event far over maxObjectSize ends the read: a
// broken or hostile apiserver cannot make the decoder buffer without
// bound. (The budget counts bytes read; what the decoder read ahead for
// the previous value is not counted again, so the bound is approximate by
// at most that read-ahead.)
func TestDecodeBounds(t *testing.T) {
	big := `{"metadata":{"name":"n"},"pad":"` + strings.Repeat("x", 2*maxObjectSize) + `"}`
	err := func() error {
		_, err := decodeList(strings.NewReader(`{"items":[`+big+`]}`), func([]byte) error { return nil })
		return err
	}()
	if !errors.As(err, new(*kubeapi.TooLargeError)) {
		t.Errorf("list with a %d-byte item: %v", len(big), err)
	}
	br := kubeapi.NewBoundedReader(strings.NewReader(`{"type":"ADDED","object":`+big+`}`), maxObjectSize)
	if _, err := nextEvent(json.NewDecoder(br), br, kindNodes); !errors.As(err, new(*kubeapi.TooLargeError)) {
		t.Errorf("watch event over the bound: %v", err)
	}
	items := strings.Repeat(`{"metadata":{"name":"n"}},`, maxListItems)
	if _, err := decodeList(strings.NewReader(`{"items":[`+items+`{"metadata":{"name":"n"}}]}`), func([]byte) error { return nil }); err == nil || !strings.Contains(err.Error(), "more than") {
		t.Errorf("list page with %d items: %v", maxListItems+1, err)
	}
	// Many small objects in a row each get the whole budget.
	var ok strings.Builder
	for range 5 {
		ok.WriteString(`{"type":"ADDED","object":{"metadata":{"name":"n"},"pad":"` + strings.Repeat("x", maxObjectSize/2) + `"}}` + "\n")
	}
	br = kubeapi.NewBoundedReader(strings.NewReader(ok.String()), maxObjectSize)
	dec := json.NewDecoder(br)
	for i := range 5 {
		if _, err := nextEvent(dec, br, kindNodes); err != nil {
			t.Fatalf("event %d of half the bound: %v", i, err)
		}
	}
}
