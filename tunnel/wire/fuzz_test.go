package wire

import (
	"bufio"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func FuzzReadConnect(f *testing.F) {
	for _, seed := range []string{
		"CONNECT 10.0.0.1:10250 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
		"CONNECT [fd00::1]:443 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nTLS bytes",
		"CONNECT kubernetes.default.svc:443 HTTP/1.0\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
		"CONNECT a HTTP/1.1\r\n\r\n",
		"CONNECT :80 HTTP/1.1\r\n\r\n",
		"CONNECT a:99999 HTTP/1.1\r\n\r\n",
		"CONNECT a:1 HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
		"CONNECT a:1 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
		"CONNECT http://a:1/ HTTP/1.1\r\n\r\n",
		"\x16\x03\x01\x02\x00",
		"",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, in string) {
		lim := &HeadLimiter{R: strings.NewReader(in), Remaining: 1024, Limited: true}
		addr, err := ReadConnect(bufio.NewReaderSize(lim, 4096))
		if err != nil {
			var se *StatusError
			if !errors.As(err, &se) {
				t.Fatalf("error %v is not a *StatusError", err)
			}
			switch se.Code {
			case 400, 405, 408, 431:
			default:
				t.Fatalf("unexpected status %d for %q", se.Code, in)
			}
			return
		}
		if _, err := SplitDialAddress(addr); err != nil {
			t.Fatalf("accepted invalid address %q: %v", addr, err)
		}
		if !strings.HasPrefix(in, "CONNECT ") {
			t.Fatalf("accepted a request that is not CONNECT: %q", in)
		}
	})
}

func FuzzParseIdentifiers(f *testing.F) {
	for _, seed := range []string{
		"host=node1&ipv4=10.0.0.5&cidr=10.42.0.0/24&default-route=true",
		"ipv6=fd00::1&ipv6=::ffff:10.0.0.1",
		"ipv4=fd00::1",
		"unknown=1",
		"host=%zz",
		"default-route=maybe",
		"cidr=10.0.0.0/33",
		"ipv4=${HOST_IP}&ipv6=:::::&default-route=",
		"",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, in string) {
		ids, err := ParseIdentifiers(in)
		if err != nil {
			return
		}
		again, err := ParseIdentifiers(ids.String())
		if err != nil {
			t.Fatalf("String() of %q does not parse: %v", in, err)
		}
		if !sameIdentifiers(ids, again) {
			t.Fatalf("round trip changed %q: %+v vs %+v", in, ids, again)
		}
		// A dial's lookup lowers the host it asks for (the server's
		// agent index): a host kept in another form matches nothing.
		for _, h := range ids.Hosts {
			if h != strings.ToLower(h) {
				t.Fatalf("host %q does not match itself", h)
			}
		}
	})
}

// sameIdentifiers compares as sets per key, since query encoding sorts keys.
func sameIdentifiers(a, b Identifiers) bool {
	return reflect.DeepEqual(a.Hosts, b.Hosts) && a.DefaultRoute == b.DefaultRoute &&
		len(a.Addrs) == len(b.Addrs) && len(a.CIDRs) == len(b.CIDRs)
}

func FuzzReadHello(f *testing.F) {
	var b strings.Builder
	WriteHello(&b, "lb.example", AgentHello{ID: "node-1", Identifiers: "host=node-1", Connected: []string{"s1", "s2"}, Token: "abc"})
	for _, seed := range []string{
		b.String(),
		"GET /konnectivity/v1/tunnel HTTP/1.1\r\nHost: x\r\nUpgrade: konnectivity-h2\r\n\r\n",
		"GET /konnectivity/v1/tunnel HTTP/1.1\r\nHost: x\r\nUpgrade: konnectivity-h2\r\nKonnectivity-Agent-Id: a b\r\n\r\n",
		"GET /konnectivity/v1/tunnel HTTP/1.1\r\nHost: x\r\nUpgrade: konnectivity-h2\r\nKonnectivity-Agent-Id: a\r\nAuthorization: Basic xx\r\n\r\n",
		"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, in string) {
		lim := &HeadLimiter{R: strings.NewReader(in), Remaining: MaxHandshakeHead, Limited: true}
		h, err := ReadHello(bufio.NewReader(lim))
		if err != nil {
			var se *StatusError
			if !errors.As(err, &se) {
				t.Fatalf("error %v is not a *StatusError", err)
			}
			if strings.Contains(err.Error(), "Bearer ") {
				t.Fatalf("error text carries the authorization header: %v", err)
			}
			return
		}
		if ValidID(h.ID) != nil {
			t.Fatalf("accepted invalid agent ID %q", h.ID)
		}
	})
}
