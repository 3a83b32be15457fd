package tunnel

import (
	"io"
	"net/netip"
	"strings"
	"testing"
)

func TestDestinationPolicy(t *testing.T) {
	p, err := NewDestinationPolicy("10.0.0.0/8,:10250,[fd00::/8]:443,192.168.1.5:8000-9000", "10.9.0.0/16,10.0.0.1:22")
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		addr  string
		port  int
		allow bool
	}{
		{"10.1.2.3", 80, true},
		{"10.9.1.1", 80, false}, // denied range wins
		{"10.0.0.1", 22, false}, // denied port
		{"10.0.0.1", 23, true},  //
		{"172.16.0.1", 10250, true},
		{"172.16.0.1", 10251, false}, // not allowed
		{"fd00::1", 443, true},
		{"fd00::1", 80, false},
		{"192.168.1.5", 8500, true},
		{"192.168.1.5", 9001, false},
		{"169.254.169.254", 80, false}, // metadata, not named by an allow rule
		{"::ffff:10.1.2.3", 80, true},  // IPv4-mapped
	}
	for _, c := range cases {
		err := p.Check(netip.MustParseAddr(c.addr), c.port)
		if (err == nil) != c.allow {
			t.Errorf("%s:%d: allowed=%v, want %v (%v)", c.addr, c.port, err == nil, c.allow, err)
		}
	}

	def, _ := NewDestinationPolicy("", "")
	if err := def.Check(netip.MustParseAddr("169.254.169.254"), 80); err == nil || !strings.Contains(err.Error(), "metadata") {
		t.Errorf("metadata address not denied by default: %v", err)
	}
	if err := def.Check(netip.MustParseAddr("10.0.0.1"), 80); err != nil {
		t.Errorf("default policy denied an ordinary address: %v", err)
	}
	explicit, _ := NewDestinationPolicy("169.254.169.254", "")
	if err := explicit.Check(netip.MustParseAddr("169.254.169.254"), 80); err != nil {
		t.Errorf("explicitly allowed metadata address denied: %v", err)
	}
	wide, _ := NewDestinationPolicy("169.254.0.0/16", "")
	if err := wide.Check(netip.MustParseAddr("169.254.169.254"), 80); err == nil {
		t.Error("a wide allow rule must not open the metadata address")
	}
	for _, bad := range []string{"10.0.0.0/33", "10.0.0.1:0", "10.0.0.1:9-1", "[fd00::1", "nonsense", ":", "1.2.3.4:http"} {
		if _, err := NewDestinationPolicy(bad, ""); err == nil {
			t.Errorf("rule %q accepted", bad)
		}
	}
}

// A denied destination is a 403 with the reason, and nothing is dialled.
func TestDeniedDestinationIs403(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, nil)
	policy, err := NewDestinationPolicy("", "127.0.0.0/8:1-1000")
	if err != nil {
		t.Fatal(err)
	}
	a := e.startAgent("a1", "", func(c *AgentConfig) { c.Destinations = policy })
	e.waitAgents(1)
	for _, target := range []string{"127.0.0.1:80", "169.254.169.254:80"} {
		conn, br, resp := e.connect(target)
		body, _ := io.ReadAll(br)
		conn.Close()
		if resp.StatusCode != 403 || !strings.Contains(string(body), "denied") {
			t.Errorf("%s: %d %q, want 403 with the reason", target, resp.StatusCode, body)
		}
	}
	if a.Stats.DialsOK.Load() != 0 {
		t.Fatal("a denied destination was dialled")
	}
	conn, _, resp := e.connect(echoServer(t)) // high port: allowed
	conn.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("allowed destination: %s", resp.Status)
	}
}

func FuzzDestinationRules(f *testing.F) {
	for _, s := range []string{"10.0.0.0/8", ":443", "[fd00::/8]:1-2", "1.2.3.4:80", "*:22", "", ",,"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := NewDestinationPolicy(s, s)
		if err != nil {
			return
		}
		p.Check(netip.MustParseAddr("10.0.0.1"), 443)
		p.Check(netip.MustParseAddr("fd00::1"), 1)
	})
}
