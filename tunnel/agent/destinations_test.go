package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// Every form an address can take, against each step of the precedence.
func TestDestinationPolicy(t *testing.T) {
	cases := []struct {
		rules DestinationRules
		addr  string
		port  int
		want  string // "" allowed, else a substring of the refusal
	}{
		// Operator allow and deny lists.
		{DestinationRules{Allow: "10.0.0.0/8,:10250,[fd00::/8]:443,192.168.1.5:8000-9000", Deny: "10.9.0.0/16,10.0.0.1:22"}, "10.1.2.3", 80, ""},
		{DestinationRules{Allow: "10.0.0.0/8", Deny: "10.9.0.0/16"}, "10.9.1.1", 80, "denied by rule 10.9.0.0/16"},
		{DestinationRules{Allow: "10.0.0.0/8", Deny: "10.0.0.1:22"}, "10.0.0.1", 22, "denied by rule 10.0.0.1:22"},
		{DestinationRules{Allow: "10.0.0.0/8", Deny: "10.0.0.1:22"}, "10.0.0.1", 23, ""},
		{DestinationRules{Allow: ":10250"}, "172.16.0.1", 10250, ""},
		{DestinationRules{Allow: ":10250"}, "172.16.0.1", 10251, "not in the allowed destinations"},
		{DestinationRules{Allow: "[fd00::/8]:443"}, "fd00::1", 443, ""},
		{DestinationRules{Allow: "[fd00::/8]:443"}, "fd00::1", 80, "not in the allowed"},
		{DestinationRules{Allow: "192.168.1.5:8000-9000"}, "192.168.1.5", 8500, ""},
		{DestinationRules{Allow: "192.168.1.5:8000-9000"}, "192.168.1.5", 9001, "not in the allowed"},

		// IPv4-mapped IPv6 is checked as IPv4, against IPv4 and mapped rules.
		{DestinationRules{Allow: "10.0.0.0/8"}, "::ffff:10.1.2.3", 80, ""},
		{DestinationRules{Deny: "10.0.0.0/8"}, "::ffff:10.1.2.3", 80, "denied by rule 10.0.0.0/8"},
		{DestinationRules{Deny: "::ffff:10.0.0.0/104"}, "10.1.2.3", 80, "denied by rule ::ffff:10.0.0.0/104"},
		{DestinationRules{Deny: "::ffff:10.0.0.1"}, "10.0.0.1", 80, "denied by rule"},

		// Zones: refused whatever the rules say, with any zone.
		{DestinationRules{}, "fd00:ec2::254%1", 80, "zoned address"},
		{DestinationRules{}, "fd00:ec2::254%lo", 80, "zoned address"},
		{DestinationRules{Deny: "::1"}, "::1%lo", 80, "zoned address"},
		{DestinationRules{}, "fd00::1%eth0", 80, "zoned address"},
		{DestinationRules{Allow: "::/0"}, "fd00::1%eth0", 80, "zoned address"},
		{DestinationRules{Open: "fe80::/10"}, "fe80::1%eth0", 80, "zoned address"},
		{DestinationRules{}, "::ffff:10.0.0.1%eth0", 80, "zoned address"},

		// Unspecified addresses are the local host.
		{DestinationRules{Deny: "127.0.0.0/8"}, "0.0.0.0", 80, "denied by rule 127.0.0.0/8"},
		{DestinationRules{Deny: "127.0.0.0/8"}, "::", 80, "denied by rule 127.0.0.0/8"},
		{DestinationRules{Deny: "127.0.0.0/8"}, "::ffff:0.0.0.0", 80, "dialled as 127.0.0.1"},
		{DestinationRules{Deny: "::1"}, "::", 80, "dialled as ::1"},
		{DestinationRules{Deny: "::1/128"}, "0.0.0.0", 80, "denied by rule ::1/128"},
		{DestinationRules{Deny: "0.0.0.0"}, "0.0.0.0", 80, "denied by rule 0.0.0.0"},
		{DestinationRules{Deny: "127.0.0.0/8:1-1000"}, "0.0.0.0", 80, "denied"},
		{DestinationRules{Deny: "127.0.0.0/8:1-1000"}, "0.0.0.0", 8080, ""},
		{DestinationRules{Deny: "127.0.0.0/8"}, "::ffff:127.0.0.1", 80, "denied by rule 127.0.0.0/8"},
		{DestinationRules{Allow: "127.0.0.1"}, "0.0.0.0", 80, ""},                    // dialled as 127.0.0.1
		{DestinationRules{Allow: "10.0.0.0/8"}, "0.0.0.0", 80, "not in the allowed"}, // the local host is not 10/8
		{DestinationRules{Allow: "0.0.0.0/32"}, "0.0.0.0", 80, "not in the allowed"}, // allowed means what is dialled
		{DestinationRules{}, "0.0.0.0", 80, ""},                                      // no rule about the local host
		{DestinationRules{Deny: "10.0.0.0/8"}, "0.0.0.0", 80, ""},                    // nor here
		{DestinationRules{Deny: "127.0.0.0/8"}, "127.255.255.254", 80, "denied by rule 127.0.0.0/8"},

		// The built-in denied ranges, by default.
		{DestinationRules{}, "169.254.169.254", 80, "built-in rule 169.254.0.0/16"},
		{DestinationRules{}, "169.254.170.2", 80, "built-in rule 169.254.0.0/16"},
		{DestinationRules{}, "169.254.170.23", 80, "built-in rule 169.254.0.0/16"},
		{DestinationRules{}, "169.254.0.1", 443, "built-in rule 169.254.0.0/16"},
		{DestinationRules{}, "::ffff:169.254.170.2", 80, "built-in rule 169.254.0.0/16"},
		{DestinationRules{}, "::ffff:169.254.169.254", 80, "built-in rule 169.254.0.0/16"},
		{DestinationRules{}, "fe80::1", 80, "built-in rule fe80::/10"},
		{DestinationRules{}, "febf::1", 80, "built-in rule fe80::/10"},
		{DestinationRules{}, "fd00:ec2::254", 80, "built-in rule fd00:ec2::254/128"},
		{DestinationRules{}, "fd00:ec2::23", 80, "built-in rule fd00:ec2::23/128"},
		{DestinationRules{}, "100.100.100.200", 80, "built-in rule 100.100.100.200/32"},
		{DestinationRules{}, "::ffff:100.100.100.200", 80, "built-in rule 100.100.100.200/32"},
		{DestinationRules{}, "168.63.129.16", 80, "built-in rule 168.63.129.16/32"},
		{DestinationRules{}, "100.100.100.201", 80, ""},
		{DestinationRules{}, "fd00:ec2::253", 80, ""},
		{DestinationRules{}, "10.0.0.1", 80, ""},

		// Open punches a hole in the built-in list only; deny and allow
		// still apply; a wide allow rule opens nothing.
		{DestinationRules{Open: "169.254.170.2"}, "169.254.170.2", 80, ""},
		{DestinationRules{Open: "169.254.170.2"}, "::ffff:169.254.170.2", 80, ""},
		{DestinationRules{Open: "169.254.170.2"}, "169.254.169.254", 80, "built-in rule"},
		{DestinationRules{Open: "169.254.170.2:80"}, "169.254.170.2", 81, "built-in rule"},
		{DestinationRules{Open: "[fd00:ec2::254]"}, "fd00:ec2::254", 80, ""},
		{DestinationRules{Open: "fe80::/10"}, "fe80::1", 80, ""},
		{DestinationRules{Open: "169.254.0.0/16", Deny: "169.254.169.254"}, "169.254.169.254", 80, "denied by rule 169.254.169.254"},
		{DestinationRules{Open: "169.254.170.2", Allow: "10.0.0.0/8"}, "169.254.170.2", 80, "not in the allowed"},
		{DestinationRules{Open: "169.254.170.2", Allow: "10.0.0.0/8,169.254.170.2"}, "169.254.170.2", 80, ""},
		{DestinationRules{Allow: "169.254.169.254"}, "169.254.169.254", 80, "--open-destinations opens it"},
		{DestinationRules{Allow: "0.0.0.0/0"}, "100.100.100.200", 80, "built-in rule"},
	}
	for _, c := range cases {
		p, err := NewDestinationPolicy(c.rules)
		if err != nil {
			t.Fatalf("%+v: %v", c.rules, err)
		}
		err = p.Check(netip.MustParseAddr(c.addr), c.port)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%+v %s port %d: refused (%v), want allowed", c.rules, c.addr, c.port, err)
		case c.want != "" && err == nil:
			t.Errorf("%+v %s port %d: allowed, want refused (%q)", c.rules, c.addr, c.port, c.want)
		case c.want != "" && !strings.Contains(err.Error(), c.want):
			t.Errorf("%+v %s port %d: %v, want the reason to say %q", c.rules, c.addr, c.port, err, c.want)
		}
	}
	if err := (&DestinationPolicy{}).Check(netip.Addr{}, 80); err == nil {
		t.Error("the zero address was allowed")
	}
}

// dialAddr is what Check checks and what the agent dials.
func TestDialAddr(t *testing.T) {
	for in, want := range map[string]string{
		"0.0.0.0":          "127.0.0.1",
		"::":               "::1",
		"::ffff:0.0.0.0":   "127.0.0.1",
		"::ffff:10.0.0.1":  "10.0.0.1",
		"10.0.0.1":         "10.0.0.1",
		"fd00::1":          "fd00::1",
		"fe80::1%eth0":     "fe80::1%eth0", // kept so Check sees and refuses it
		"::ffff:1.2.3.4%x": "::ffff:1.2.3.4%x",
	} {
		if got := dialAddr(netip.MustParseAddr(in)).String(); got != want {
			t.Errorf("dialAddr(%s) = %s, want %s", in, got, want)
		}
	}
}

func TestDestinationRuleErrors(t *testing.T) {
	for _, c := range []struct {
		rules DestinationRules
		want  string
	}{
		{DestinationRules{Allow: "10.0.0.0/33"}, "allowed destinations"},
		{DestinationRules{Allow: "10.0.0.1:0"}, "want 1-65535"},
		{DestinationRules{Allow: "10.0.0.1:9-1"}, "bad port range"},
		{DestinationRules{Allow: "[fd00::1"}, "missing ]"},
		{DestinationRules{Allow: "nonsense"}, "nonsense"},
		{DestinationRules{Allow: ":"}, "names neither"},
		{DestinationRules{Allow: "1.2.3.4:http"}, "want 1-65535"},
		{DestinationRules{Deny: "[fe80::1%eth0]"}, "zoned"},
		{DestinationRules{Deny: "fe80::%eth0/64"}, "zoned"},
		{DestinationRules{Open: ":80"}, "must name addresses"},
		{DestinationRules{Open: "10.0.0.0/8"}, "opens nothing"},
		{DestinationRules{Open: "bad"}, "opened destinations"},
	} {
		_, err := NewDestinationPolicy(c.rules)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error saying %q", c.rules, err, c.want)
		}
	}
}

// guardDialer dials loopback addresses only and records every address it
// was asked for, so a policy that fails shows up as a recorded dial and
// never as traffic off the machine.
type guardDialer struct {
	mu    sync.Mutex
	asked []string
}

func (g *guardDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	g.mu.Lock()
	g.asked = append(g.asked, addr)
	g.mu.Unlock()
	ap, err := netip.ParseAddrPort(addr)
	if err != nil || !ap.Addr().IsLoopback() || ap.Addr().Zone() != "" {
		return nil, fmt.Errorf("test guard: %s is not a loopback address, not dialled", addr)
	}
	return (&net.Dialer{}).DialContext(ctx, network, addr)
}

func (g *guardDialer) take() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	a := g.asked
	g.asked = nil
	return a
}

// fakeResolver answers names from a table.
func fakeResolver(names map[string][]netip.Addr) func(context.Context, string) ([]netip.Addr, error) {
	return func(_ context.Context, host string) ([]netip.Addr, error) {
		if a, ok := names[host]; ok {
			return a, nil
		}
		return nil, errors.New("fake resolver: no such host " + host)
	}
}

// Each destination form through the whole path (frontend, server, agent):
// refused with 403 and the reason, nothing dialled; the allowed ones
// dialled at the address that was checked.
func TestDestinationFormsThroughTunnel(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	echo := tunneltest.EchoServer(t)
	_, echoPort, _ := net.SplitHostPort(echo)
	policy, err := NewDestinationPolicy(DestinationRules{Deny: "127.0.0.0/8:1-1000,[::1]:1-1000"})
	if err != nil {
		t.Fatal(err)
	}
	guard := &guardDialer{}
	mustAddrs := func(s ...string) []netip.Addr {
		var a []netip.Addr
		for _, x := range s {
			a = append(a, netip.MustParseAddr(x))
		}
		return a
	}
	a := e.startAgent("a1", "", func(c *Config) {
		c.Destinations = policy
		c.Dialer = guard.dial
		c.Resolver = fakeResolver(map[string][]netip.Addr{
			"metadata.google.internal": mustAddrs("169.254.169.254"),
			"ecs.test":                 mustAddrs("::ffff:169.254.170.2"),
			"any.test":                 mustAddrs("0.0.0.0"),
			"zoned.test":               mustAddrs("fe80::1%lo"),
			"mixed.test":               mustAddrs("169.254.170.2", "100.100.100.200", "127.0.0.1"),
		})
	})
	e.WaitAgents(1)
	refused := []struct{ target, reason string }{
		{"0.0.0.0:80", "denied by rule 127.0.0.0/8:1-1000"},
		{"[::]:80", "denied by rule"},
		{"[::ffff:0.0.0.0]:80", "dialled as 127.0.0.1"},
		{"[::ffff:127.0.0.1]:80", "denied by rule 127.0.0.0/8:1-1000"},
		{"127.0.0.1:80", "denied by rule 127.0.0.0/8:1-1000"},
		{"[::1]:80", "denied by rule [::1]:1-1000"},
		{"[fd00:ec2::254%251]:80", "zoned address"}, // RFC 6874: %25 is "%"
		{"[fd00:ec2::254%25lo]:80", "zoned address"},
		{"[::1%25lo]:80", "zoned address"},
		{"[fd00:ec2::254]:80", "built-in rule fd00:ec2::254/128"},
		{"[fd00:ec2::23]:80", "built-in rule fd00:ec2::23/128"},
		{"169.254.169.254:80", "built-in rule 169.254.0.0/16"},
		{"169.254.170.2:80", "built-in rule 169.254.0.0/16"},
		{"[::ffff:169.254.170.2]:80", "built-in rule 169.254.0.0/16"},
		{"100.100.100.200:80", "built-in rule 100.100.100.200/32"},
		{"168.63.129.16:80", "built-in rule 168.63.129.16/32"},
		{"[fe80::1]:80", "built-in rule fe80::/10"},
		{"metadata.google.internal:80", "built-in rule 169.254.0.0/16"},
		{"ecs.test:80", "built-in rule 169.254.0.0/16"},
		{"any.test:80", "denied by rule 127.0.0.0/8:1-1000"},
		{"zoned.test:80", "zoned address"},
	}
	for _, c := range refused {
		conn, br, resp := e.Connect(c.target)
		body, _ := io.ReadAll(br)
		conn.Close()
		if resp.StatusCode != 403 || !strings.Contains(string(body), c.reason) {
			t.Errorf("CONNECT %s: %d %q, want 403 saying %q", c.target, resp.StatusCode, body, c.reason)
		}
	}
	if asked := guard.take(); len(asked) > 0 {
		t.Fatalf("refused destinations reached the dialler: %v", asked)
	}
	if n := dialsOK(t, a.Agent); n != 0 {
		t.Fatalf("%d refused destinations were dialled", n)
	}

	// Allowed: each is dialled at the address that was checked, and only there.
	allowed := []struct{ target, dialled string }{
		{echo, echo},
		{"0.0.0.0:" + echoPort, "127.0.0.1:" + echoPort},
		{"[::ffff:0.0.0.0]:" + echoPort, "127.0.0.1:" + echoPort},
		{"[::ffff:127.0.0.1]:" + echoPort, "127.0.0.1:" + echoPort},
		{"any.test:" + echoPort, "127.0.0.1:" + echoPort},
		{"mixed.test:" + echoPort, "127.0.0.1:" + echoPort}, // the denied addresses are skipped
	}
	for _, c := range allowed {
		conn := e.EchoOne(c.target)
		conn.Close()
		if asked := guard.take(); len(asked) != 1 || asked[0] != c.dialled {
			t.Errorf("CONNECT %s: dialled %v, want exactly [%s]", c.target, asked, c.dialled)
		}
	}
}

// The gRPC front door refuses a zoned address before any agent sees it.
func TestGRPCZonedDestinationRefused(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	guard := &guardDialer{}
	e.startAgent("a1", "", func(c *Config) { c.Dialer = guard.dial })
	e.WaitAgents(1)
	sock := e.grpcSocket(t)
	for _, addr := range []string{"[fd00:ec2::254%1]:80", "[::1%lo]:" + strconv.Itoa(80), "[fe80::1]:80", "0.0.0.0:1"} {
		c := tunneltest.OpenGRPC(t, sock, grpcwire.ProxyMethod)
		c.Write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: addr, Random: 7})
		p, err := c.Read()
		if err != nil || p.Type != grpcwire.DialRsp || p.Random != 7 || p.Error == "" {
			t.Errorf("DIAL_REQ %s: %+v, %v; want a DIAL_RSP with an error", addr, p, err)
			continue
		}
		t.Logf("DIAL_REQ %s: %s", addr, p.Error)
	}
	for _, a := range guard.take() {
		if a != "127.0.0.1:1" { // 0.0.0.0:1 is allowed and dialled as the local host
			t.Errorf("the agent dialled %s", a)
		}
	}
}

func FuzzDestinationRules(f *testing.F) {
	for _, s := range []string{"10.0.0.0/8", ":443", "[fd00::/8]:1-2", "1.2.3.4:80", "*:22", "", ",,", "169.254.170.2", "::ffff:10.0.0.0/104", "[fe80::1%eth0]", "0.0.0.0/0"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, r := range []DestinationRules{{Allow: s}, {Deny: s}, {Open: s}} {
			p, err := NewDestinationPolicy(r)
			if err != nil {
				continue
			}
			p.Check(netip.MustParseAddr("10.0.0.1"), 443)
			p.Check(netip.MustParseAddr("fd00::1"), 1)
			// No rule opens a zoned address, and nothing but an Open
			// rule opens a built-in denied one.
			if p.Check(netip.MustParseAddr("fe80::1%eth0"), 80) == nil {
				t.Fatalf("%+v allowed a zoned address", r)
			}
			if r.Open == "" && p.Check(netip.MustParseAddr("169.254.169.254"), 80) == nil {
				t.Fatalf("%+v opened the metadata address", r)
			}
		}
	})
}

// FuzzDestinationCheck: whatever the address, a refusal is not an allow
// of what is dialled: an allowed address is never zoned, link-local or
// metadata under the default policy, and deny of the loopback ranges
// leaves no way to the local host.
func FuzzDestinationCheck(f *testing.F) {
	for _, s := range []string{"0.0.0.0", "::", "::ffff:0.0.0.0", "fd00:ec2::254%1", "::ffff:169.254.170.2", "fe80::1", "127.0.0.1", "10.0.0.1", "::1%lo", "100.100.100.200", "::ffff:127.0.0.2"} {
		f.Add(s)
	}
	def, _ := NewDestinationPolicy(DestinationRules{})
	noLocal, _ := NewDestinationPolicy(DestinationRules{Deny: "127.0.0.0/8,::1"})
	f.Fuzz(func(t *testing.T, s string) {
		ip, err := netip.ParseAddr(s)
		if err != nil {
			return
		}
		d := dialAddr(ip)
		if def.Check(ip, 80) == nil {
			if d.Zone() != "" || d.IsLinkLocalUnicast() || d == netip.MustParseAddr("100.100.100.200") || d == netip.MustParseAddr("fd00:ec2::254") {
				t.Fatalf("default policy allowed %s, dialled as %s", ip, d)
			}
		}
		if noLocal.Check(ip, 80) == nil && (d.IsLoopback() || d.IsUnspecified()) {
			t.Fatalf("a deny of the loopback ranges allowed %s, dialled as %s", ip, d)
		}
	})
}

// BenchmarkDestinationCheck is the policy's share of a dial: an allowed
// address against operator rules and the built-in list.
func BenchmarkDestinationCheck(b *testing.B) {
	p, err := NewDestinationPolicy(DestinationRules{Allow: "10.0.0.0/8,:10250", Deny: "127.0.0.0/8,::1,10.9.0.0/16", Open: "169.254.170.2:80"})
	if err != nil {
		b.Fatal(err)
	}
	addrs := []netip.Addr{netip.MustParseAddr("10.1.2.3"), netip.MustParseAddr("::ffff:10.1.2.3"), netip.MustParseAddr("fd00::1")}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		p.Check(addrs[i%len(addrs)], 10250)
	}
}

// The "node" keyword allows loopback and what Owns says is the agent's
// node; other Allow rules add to it, and Deny and the built-in rules still
// win.
func TestDestinationPolicyOwnNode(t *testing.T) {
	own := map[netip.Addr]bool{netip.MustParseAddr("10.0.0.5"): true, netip.MustParseAddr("10.244.0.7"): true, netip.MustParseAddr("fd10::7"): true, netip.MustParseAddr("169.254.1.1"): true}
	rules := func(allow, deny string) DestinationRules {
		return DestinationRules{Allow: allow, Deny: deny, OwnNode: "node-a", Owns: func(a netip.Addr) bool { return own[a] }}
	}
	for _, tc := range []struct {
		rules DestinationRules
		addr  string
		want  string
	}{
		{rules("node", ""), "10.0.0.5", ""},
		{rules("node", ""), "10.244.0.7", ""},
		{rules("node", ""), "::ffff:10.244.0.7", ""},
		{rules("node", ""), "fd10::7", ""},
		{rules("node", ""), "127.0.0.1", ""},
		{rules("node", ""), "::1", ""},
		{rules("node", ""), "0.0.0.0", ""},
		{rules("node", ""), "10.244.1.7", `not loopback, nor an address, pod CIDR or pod of this agent's node "node-a"`},
		{rules(" node , 192.168.0.0/16", ""), "192.168.3.3", ""},
		{rules("192.168.0.0/16,node", ""), "10.244.1.7", "node-a"},
		{rules("node", "10.244.0.7"), "10.244.0.7", "denied by rule 10.244.0.7"},
		{rules("node", ""), "169.254.1.1", "built-in rule"},
	} {
		p, err := NewDestinationPolicy(tc.rules)
		if err != nil {
			t.Fatalf("%+v: %v", tc.rules, err)
		}
		err = p.Check(netip.MustParseAddr(tc.addr), 443)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("allow %q deny %q: %s refused: %v", tc.rules.Allow, tc.rules.Deny, tc.addr, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("allow %q deny %q: %s: got %v, want %q", tc.rules.Allow, tc.rules.Deny, tc.addr, err, tc.want)
		}
	}
	if _, err := NewDestinationPolicy(DestinationRules{Allow: "node"}); err == nil {
		t.Error("the node rule without the node's view was accepted")
	}
	if !HasNodeRule("10.0.0.0/8, node") || HasNodeRule("10.0.0.0/8,nodes") {
		t.Error("HasNodeRule")
	}
}

// A destination socket's kernel buffers are bounded by its path's segment
// size: thousands of tunnels must not fill the node's TCP memory with
// buffers the kernel grows on its own, and a loopback path's 64 KiB
// segments must still fit several to a buffer.
func TestDestinationSocketsBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() { c, _ := ln.Accept(); accepted <- c }()
	var c Config
	c.setDefaults()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := c.Dialer(ctx, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if peer := <-accepted; peer != nil {
		defer peer.Close()
	}
	raw, err := conn.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var snd, rcv, mss int
	raw.Control(func(fd uintptr) {
		snd, _ = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF)
		rcv, _ = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF)
		mss, _ = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_MAXSEG)
	})
	// The kernel doubles a buffer it is given, for its bookkeeping.
	want := 2 * destinationBufferFor(mss)
	if snd != want || rcv != want {
		t.Errorf("destination socket buffers (MSS %d): send %d, receive %d; want %d each", mss, snd, rcv, want)
	}
	if snd < 4*mss {
		t.Errorf("a loopback destination's send buffer holds %d bytes, under four %d-byte segments", snd, mss)
	}
	for _, c := range []struct{ mss, want int }{{1448, 32 << 10}, {8948, 32 << 10}, {65483, 130966}, {0, 32 << 10}} {
		if got := destinationBufferFor(c.mss); got != c.want {
			t.Errorf("destinationBufferFor(%d) = %d, want %d", c.mss, got, c.want)
		}
	}
}
