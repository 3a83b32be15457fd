package proxydial

import (
	"bufio"
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/testnet"
	"golang.org/x/net/http/httpproxy"
)

// fakeProxy answers each connection with serve, after reading the
// CONNECT request head; it sends the request on reqs.
func fakeProxy(t *testing.T, serve func(c net.Conn, req *http.Request)) (addr string, reqs chan *http.Request) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	reqs = make(chan *http.Request, 10)
	done := make(chan struct{})
	conns := make(chan net.Conn, 10)
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns <- c
			req, err := http.ReadRequest(bufio.NewReader(c))
			if err != nil {
				c.Close()
				continue
			}
			reqs <- req
			serve(c, req)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		close(conns)
		for c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String(), reqs
}

func dialerFor(proxy, noProxy string) *Dialer {
	return New((&httpproxy.Config{HTTPSProxy: proxy, NoProxy: noProxy}).ProxyFunc())
}

func TestConnectThroughProxy(t *testing.T) {
	testnet.CheckNoLeaks(t)
	addr, reqs := fakeProxy(t, func(c net.Conn, req *http.Request) {
		io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n")
		buf := make([]byte, 5)
		if _, err := io.ReadFull(c, buf); err == nil {
			c.Write(buf) // the client's first bytes come back
		}
	})
	d := dialerFor("http://user:s3cret@"+addr, "")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := d.DialContext(ctx, "server.example:8132")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	req := <-reqs
	if req.Method != http.MethodConnect || req.Host != "server.example:8132" {
		t.Errorf("request %s %s, want CONNECT server.example:8132", req.Method, req.Host)
	}
	if got, want := req.Header.Get("Proxy-Authorization"), "Basic "+base64.StdEncoding.EncodeToString([]byte("user:s3cret")); got != want {
		t.Errorf("Proxy-Authorization %q, want %q", got, want)
	}
	// After the head, the connection is the target's.
	io.WriteString(conn, "hello")
	buf := make([]byte, 5)
	if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != "hello" {
		t.Errorf("read %q, %v; want hello", buf, err)
	}
}

func TestProxyRefusal(t *testing.T) {
	testnet.CheckNoLeaks(t)
	addr, _ := fakeProxy(t, func(c net.Conn, req *http.Request) {
		io.WriteString(c, "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
		c.Close()
	})
	d := dialerFor("http://user:s3cret@"+addr, "")
	_, err := d.DialContext(context.Background(), "server.example:8132")
	if err == nil {
		t.Fatal("dial through a refusing proxy succeeded")
	}
	msg := err.Error()
	if !strings.Contains(msg, "http://"+addr) || !strings.Contains(msg, "403 Forbidden") {
		t.Errorf("error %q does not name the proxy and the status", msg)
	}
	if strings.Contains(msg, "s3cret") || strings.Contains(msg, "user") {
		t.Errorf("error %q carries the proxy's credentials", msg)
	}
}

func TestSilentProxyBoundedByContext(t *testing.T) {
	testnet.CheckNoLeaks(t)
	addr, _ := fakeProxy(t, func(net.Conn, *http.Request) {}) // reads the request, never answers
	d := dialerFor("http://"+addr, "")
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := d.DialContext(ctx, "server.example:8132")
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v, want the context's deadline", err)
	}
}

// A proxy that speaks before the client's TLS does is broken: refused.
func TestDataAfterReplyHeadRefused(t *testing.T) {
	testnet.CheckNoLeaks(t)
	addr, _ := fakeProxy(t, func(c net.Conn, req *http.Request) {
		io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\nearly")
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := dialerFor("http://"+addr, "").DialContext(ctx, "server.example:8132")
	if err == nil || !strings.Contains(err.Error(), "data after the reply head") {
		t.Fatalf("err %v, want the early data refused", err)
	}
}

func TestHugeReplyHeadRefused(t *testing.T) {
	testnet.CheckNoLeaks(t)
	addr, _ := fakeProxy(t, func(c net.Conn, req *http.Request) {
		io.WriteString(c, "HTTP/1.1 200 OK\r\n")
		line := "X-Pad: " + strings.Repeat("a", 1000) + "\r\n"
		for i := 0; i < 2*maxReplyHead/len(line); i++ {
			if _, err := io.WriteString(c, line); err != nil {
				return
			}
		}
	})
	d := dialerFor("http://"+addr, "")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := d.DialContext(ctx, "server.example:8132")
	if err == nil || !strings.Contains(err.Error(), "reply head larger than") {
		t.Fatalf("err %v, want the head bound", err)
	}
}

func TestProxyChoice(t *testing.T) {
	for _, tc := range []struct {
		proxy, noProxy, addr, want string
	}{
		{"http://p.example:3128", "", "server.example:8132", "http://p.example:3128"},
		{"http://u:pw@p.example:3128", "", "server.example:8132", "http://p.example:3128"},
		{"http://p.example:3128", "other.example", "server.example:8132", "http://p.example:3128"},
		{"http://p.example:3128", "example", "server.example:8132", "direct"}, // a domain covers its subdomains
		{"http://p.example:3128", ".example", "server.example:8132", "direct"},
		{"http://p.example:3128", "server.example", "server.example:8132", "direct"},
		{"http://p.example:3128", "10.0.0.0/8", "10.1.2.3:8132", "direct"},
		{"http://p.example:3128", "10.0.0.0/8", "192.0.2.1:8132", "http://p.example:3128"},
		{"http://p.example:3128", "", "127.0.0.1:8132", "direct"}, // loopback is never proxied
		{"", "", "server.example:8132", "direct"},
	} {
		p, err := dialerFor(tc.proxy, tc.noProxy).Proxy(tc.addr)
		if err != nil {
			t.Errorf("%+v: %v", tc, err)
			continue
		}
		if got := Name(p); got != tc.want {
			t.Errorf("%+v: proxy %s, want %s", tc, got, tc.want)
		}
	}
	for _, scheme := range []string{"socks5", "https"} {
		if _, err := dialerFor(scheme+"://p.example:1080", "").Proxy("server.example:8132"); err == nil || !strings.Contains(err.Error(), `scheme "`+scheme+`" is not supported`) {
			t.Errorf("%s proxy: err %v, want the scheme refused", scheme, err)
		}
	}
}
