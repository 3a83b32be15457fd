package server

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/internal/promtext"
)

func TestConnectEchoSequentialAndConcurrent(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)

	roundTrip := func(i int) error {
		conn, br, resp := e.Connect(echo)
		defer conn.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		msg := fmt.Sprintf("hello %d", i)
		if _, err := io.WriteString(conn, msg); err != nil {
			return err
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(br, got); err != nil {
			return err
		}
		if string(got) != msg {
			return fmt.Errorf("echo %q, want %q", got, msg)
		}
		return nil
	}
	for i := range 100 {
		if err := roundTrip(i); err != nil {
			t.Fatalf("sequential %d: %v", i, err)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 200)
	for i := range 200 {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- roundTrip(i) }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// The 200 must be exactly what kube-apiserver's dialer expects, with
// nothing behind it, and bytes sent right behind the CONNECT head must
// reach the destination.
func TestConnectWireFormatAndEarlyBytes(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)

	conn, err := net.Dial("unix", e.UDS)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nearly-bytes", echo)
	want := wire.ConnectEstablished + "early-bytes"
	got := make([]byte, len(want))
	if _, err := io.ReadFull(conn, got); err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Fatalf("got %q, want %q", got, want)
	}
}

func TestHalfCloseFromClient(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	// The destination reads everything, then answers with its SHA-256 and a
	// large tail, so the answer flows after the client's half-close.
	dest := tunneltest.ServeTCP(t, func(c net.Conn) {
		h := sha256.New()
		io.Copy(h, c)
		c.Write(h.Sum(nil))
		c.Write(bytes.Repeat([]byte("x"), 1<<20))
	})
	conn, br, resp := e.Connect(dest)
	defer conn.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	payload := make([]byte, 3<<20)
	rand.Read(payload)
	if _, err := conn.Write(payload); err != nil {
		t.Fatal(err)
	}
	conn.(*net.UnixConn).CloseWrite()
	answer, err := io.ReadAll(br)
	if err != nil {
		t.Fatalf("read after half-close: %v", err)
	}
	sum := sha256.Sum256(payload)
	if len(answer) != 32+1<<20 || !bytes.Equal(answer[:32], sum[:]) {
		t.Fatalf("answer: %d bytes, checksum match %v", len(answer), len(answer) >= 32 && bytes.Equal(answer[:32], sum[:]))
	}
}

// A destination that closes first: the client sees everything it sent,
// then EOF, even while it keeps its own side open.
func TestDestinationClosesFirst(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	dest := tunneltest.ServeTCP(t, func(c net.Conn) { io.WriteString(c, "bye") })
	conn, br, resp := e.Connect(dest)
	defer conn.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	got, err := io.ReadAll(br)
	if err != nil || string(got) != "bye" {
		t.Fatalf("got %q, %v", got, err)
	}
}

func TestLargeTransferBothDirections(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, br, resp := e.Connect(echo)
			defer conn.Close()
			if resp.StatusCode != 200 {
				t.Errorf("status %d", resp.StatusCode)
				return
			}
			payload := make([]byte, 8<<20)
			rand.Read(payload)
			go func() {
				conn.Write(payload)
				conn.(*net.UnixConn).CloseWrite()
			}()
			h := sha256.New()
			n, err := io.Copy(h, br)
			if err != nil || n != int64(len(payload)) {
				t.Errorf("echoed %d bytes, err %v", n, err)
				return
			}
			if want := sha256.Sum256(payload); !bytes.Equal(h.Sum(nil), want[:]) {
				t.Error("checksum mismatch")
			}
		}()
	}
	wg.Wait()
}

func TestDialFailures(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) { c.DialTimeout = 500 * time.Millisecond })
	block := make(chan struct{})
	defer close(block)
	e.startAgent("a1", "", func(c *agent.Config) {
		inner := c.Dialer
		c.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if addr == "192.0.2.1:443" { // a destination that never answers
				select {
				case <-ctx.Done():
					return nil, ctx.Err()
				case <-block:
					return nil, errors.New("test ended")
				}
			}
			if inner != nil {
				return inner(ctx, network, addr)
			}
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		}
	})
	e.WaitAgents(1)

	closedPort := func() string {
		ln, _ := net.Listen("tcp", "127.0.0.1:0")
		addr := ln.Addr().String()
		ln.Close()
		return addr
	}()
	cases := []struct {
		target string
		code   int
		body   string
	}{
		{closedPort, 502, "connection refused"},
		{"192.0.2.1:443", 504, "no answer within"},
		{"127.0.0.1:0", 400, "port out of range"},
		{"no-port", 400, "missing port"},
	}
	for _, c := range cases {
		start := time.Now()
		conn, br, resp := e.Connect(c.target)
		body, _ := io.ReadAll(br)
		conn.Close()
		if resp.StatusCode != c.code || !strings.Contains(string(body), c.body) {
			t.Errorf("CONNECT %s: %d %q, want %d containing %q", c.target, resp.StatusCode, body, c.code, c.body)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("CONNECT %s took %s", c.target, d)
		}
	}
}

func TestNoAgent503(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) { c.AgentWait = 200 * time.Millisecond })
	conn, br, resp := e.Connect("127.0.0.1:80")
	body, _ := io.ReadAll(br)
	conn.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(body), "no agent available") {
		t.Fatalf("got %d %q", resp.StatusCode, body)
	}
}

// A dial that arrives before any agent waits for one instead of failing.
func TestDialWaitsForAgent(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	m := promtext.NewRegistry()
	e := newEnv(t, func(c *Config) {
		c.AgentWait = 5 * time.Second
		c.Metrics = m
	})
	echo := tunneltest.EchoServer(t)
	conn, err := net.DialTimeout("unix", e.UDS, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", echo)
	tunneltest.WaitUntil(t, func() bool {
		var b strings.Builder
		m.WriteText(&b)
		return strings.Contains(b.String(), "konnectivity_network_proxy_server_pending_backend_dials 1\n")
	}, "the dial waits for an agent")
	if n := e.srv.AgentCount(); n != 0 {
		t.Fatalf("%d agents before the late one started", n)
	}
	e.startAgent("late", "", nil)
	resp, err := http.ReadResponse(tunneltest.BufioReader(conn), nil)
	if err != nil {
		t.Fatalf("read CONNECT answer: %v", err)
	}
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
}

// Bad HTTP/1.1 input on the HTTP CONNECT door (an HTTP/2 client gets an
// HTTP/2 answer: mode_mismatch_test.go).
func TestMalformedFrontendRequests(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) { c.HeaderTimeout = 300 * time.Millisecond })
	cases := []struct {
		name, send string
		code       int
	}{
		{"garbage", "\x16\x03\x01 hello\r\n\r\n", 400},
		{"GET", "GET / HTTP/1.1\r\nHost: x\r\n\r\n", 405},
		{"huge header", "CONNECT a:1 HTTP/1.1\r\nX: " + strings.Repeat("a", 64<<10) + "\r\n\r\n", 431},
		{"slow header", "CONNECT a:1 HTTP/1.1\r\n", 408},
		{"body", "CONNECT a:1 HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 400},
	}
	for _, c := range cases {
		conn, err := net.Dial("unix", e.UDS)
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		go io.WriteString(conn, c.send)
		resp, err := http.ReadResponse(tunneltest.BufioReader(conn), nil)
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
		} else if resp.StatusCode != c.code {
			t.Errorf("%s: status %d, want %d", c.name, resp.StatusCode, c.code)
		}
		conn.Close()
	}
	// The server still serves everyone else.
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	conn, _, resp := e.Connect(tunneltest.EchoServer(t))
	conn.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("after bad input: status %d", resp.StatusCode)
	}
}

// One tunnel whose client stops reading (and one whose destination stops
// reading) must not slow another tunnel on the same agent.
func TestStalledTunnelDoesNotBlockOthers(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	var fired, filled atomic.Int64 // bytes the firehose and the stalled client got written
	firehose := tunneltest.ServeTCP(t, func(c net.Conn) {
		buf := make([]byte, 64<<10)
		for {
			n, err := c.Write(buf)
			fired.Add(int64(n))
			if err != nil {
				return
			}
		}
	})
	stop := make(chan struct{})
	sink := tunneltest.ServeTCP(t, func(c net.Conn) { <-stop }) // never reads
	t.Cleanup(func() { close(stop) })                           // runs before ServeTCP's cleanup
	echo := tunneltest.EchoServer(t)

	stalledReader, _, resp := e.Connect(firehose) // we never read it
	defer stalledReader.Close()
	stalledDest, _, resp2 := e.Connect(sink)
	defer stalledDest.Close()
	if resp.StatusCode != 200 || resp2.StatusCode != 200 {
		t.Fatal("setup dials failed")
	}
	go func() { // fill the sink's windows
		buf := make([]byte, 64<<10)
		stalledDest.SetWriteDeadline(time.Now().Add(3 * time.Second))
		for {
			n, err := stalledDest.Write(buf)
			filled.Add(int64(n))
			if err != nil {
				return
			}
		}
	}()
	tunneltest.WaitStalled(t, "both stalled tunnels' windows full", &fired, &filled)

	conn, br, resp3 := e.Connect(echo)
	defer conn.Close()
	if resp3.StatusCode != 200 {
		t.Fatalf("status %d", resp3.StatusCode)
	}
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 16)
	for i := range 1000 {
		msg := fmt.Sprintf("ping %11d", i)
		if _, err := io.WriteString(conn, msg); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(br, buf); err != nil {
			t.Fatalf("echo %d behind stalled tunnels: %v", i, err)
		}
	}
}

// When an agent goes away, its tunnels end at once on the client side and
// new dials go to the remaining agent.
func TestAgentLossEndsTunnelsAndFailsOver(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	var mu sync.Mutex
	var toServer []net.Conn
	a1 := e.startAgent("a1", "", func(c *agent.Config) {
		c.ServerDialer = func(ctx context.Context, addr string) (net.Conn, error) {
			conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			if err == nil {
				mu.Lock()
				toServer = append(toServer, conn)
				mu.Unlock()
			}
			return conn, err
		}
	})
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)
	conn, br, resp := e.Connect(echo)
	defer conn.Close()
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	mu.Lock()
	for _, c := range toServer { // abrupt: the agent's connection drops
		c.Close()
	}
	mu.Unlock()
	a1.Stop()
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := br.ReadByte(); err == nil {
		t.Fatal("tunnel still open after its agent went away")
	} else if errors.Is(err, context.DeadlineExceeded) || tunneltest.IsTimeout(err) {
		t.Fatal("tunnel did not end after its agent went away")
	}
	e.WaitAgents(0)
	e.startAgent("a2", "", nil)
	e.WaitAgents(1)
	conn2, _, resp2 := e.Connect(echo)
	conn2.Close()
	if resp2.StatusCode != 200 {
		t.Fatalf("after failover: %s", resp2.Status)
	}
}

// destHost sends a dial to the agent whose identifiers name the
// destination; default spreads the rest.
func TestDestHostRouting(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) {
		c.Strategies = []Strategy{StrategyDestHost, StrategyDefault}
		c.Identity.RouteAgents = []string{"b"} // b advertises a cidr=
	})
	a := e.startAgent("a", "ipv4=127.0.0.1&host=localhost", nil)
	b := e.startAgent("b", "cidr=127.0.0.0/8", nil)
	e.WaitAgents(2)
	echo := tunneltest.EchoServer(t)
	_, port, _ := net.SplitHostPort(echo)
	dial := func(host string) {
		conn, _, resp := e.Connect(net.JoinHostPort(host, port))
		conn.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %s", host, resp.Status)
		}
	}
	for range 10 {
		dial("127.0.0.1") // exact match beats the CIDR
		dial("localhost")
	}
	if a.dialsOK() != 20 || b.dialsOK() != 0 {
		t.Fatalf("exact: a=%d b=%d, want 20/0", a.dialsOK(), b.dialsOK())
	}
	// 127.0.0.5 is named by no exact identifier, only by b's CIDR.
	// Any address in 127/8 is loopback on Linux.
	ln, err := net.Listen("tcp", "127.0.0.5:0")
	if err != nil {
		t.Fatalf("listen on 127.0.0.5: %v", err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	for range 10 {
		conn, _, resp := e.Connect(ln.Addr().String())
		conn.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("127.0.0.5: %s", resp.Status)
		}
	}
	if a.dialsOK() != 20 || b.dialsOK() != 10 {
		t.Fatalf("cidr: a=%d b=%d, want 20/10", a.dialsOK(), b.dialsOK())
	}
}

func TestStrategyDefaultSpreads(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	a := e.startAgent("a", "", nil)
	b := e.startAgent("b", "", nil)
	e.WaitAgents(2)
	echo := tunneltest.EchoServer(t)
	for range 40 {
		conn, _, resp := e.Connect(echo)
		conn.Close()
		if resp.StatusCode != 200 {
			t.Fatal(resp.Status)
		}
	}
	if a.dialsOK() == 0 || b.dialsOK() == 0 {
		t.Fatalf("default strategy did not spread: a=%d b=%d", a.dialsOK(), b.dialsOK())
	}
}

func TestAgentAuthRefusals(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) { c.HeaderTimeout = 500 * time.Millisecond })
	// Garbage and TLS-less bytes on the agent port: each is closed and
	// counted as a refusal.
	junk := []string{"GET / HTTP/1.1\r\n\r\n", "\x00\x01\x02garbage", ""}
	for _, b := range junk {
		c, err := net.Dial("tcp", e.AgentAddr)
		if err != nil {
			t.Fatal(err)
		}
		io.WriteString(c, b)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.Copy(io.Discard, c); tunneltest.IsTimeout(err) { // the server must close it
			t.Errorf("agent port kept a connection that sent %q", b)
		}
		c.Close()
	}
	tunneltest.WaitUntil(t, func() bool { return e.srv.Stats.AgentsRefused.Load() == int64(len(junk)) }, "every junk connection counted as refused")
	before := e.srv.Stats.AgentsRefused.Load()

	// An agent with a certificate from another CA fails the TLS handshake:
	// wait for its refusals to be counted, and it must never be admitted
	// meanwhile.
	other := tunneltest.NewPKI(t)
	bad := e.startAgent("foreign", "", func(c *agent.Config) {
		c.TLS = func(name string) (*tls.Config, error) {
			return &tls.Config{RootCAs: e.PKI.Pool, ServerName: name, Certificates: []tls.Certificate{other.AgentCert}}, nil
		}
	})
	admitted := false
	tunneltest.WaitUntil(t, func() bool {
		admitted = admitted || e.srv.AgentCount() != 0
		return admitted || e.srv.Stats.AgentsRefused.Load() >= before+2
	}, "the foreign agent refused twice")
	if admitted {
		t.Fatal("foreign agent admitted")
	}
	bad.Stop()
	if n := e.srv.AgentCount(); n != 0 {
		t.Fatalf("foreign agent admitted: server has %d agents", n)
	}
	// A good agent still gets in and works.
	e.startAgent("good", "", nil)
	e.WaitAgents(1)
	conn, _, resp := e.Connect(tunneltest.EchoServer(t))
	conn.Close()
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
}

func TestAuthenticateAgentStatus(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) {
		c.AgentTLS.ClientAuth = tls.NoClientCert
		c.AuthenticateAgent = func(ctx context.Context, cr AgentCredentials) error {
			if cr.Token != "good-token" {
				return &wire.StatusError{Code: http.StatusUnauthorized, Msg: "bad token"}
			}
			return nil
		}
	})
	// Speak the handshake by hand to see the status.
	hello := func(token string) (*wire.ServerReply, error) {
		c, err := tls.Dial("tcp", e.AgentAddr, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1"})
		if err != nil {
			return nil, err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		wire.WriteHello(c, "127.0.0.1", wire.AgentHello{ID: "x", Token: token})
		r, err := wire.ReadReply(tunneltest.BufioReader(c))
		return &r, err
	}
	if _, err := hello("wrong"); wire.StatusCode(err) != 401 || !strings.Contains(err.Error(), "bad token") {
		t.Fatalf("wrong token: %v", err)
	}
	if r, err := hello("good-token"); err != nil || r.ServerID != "s1" {
		t.Fatalf("good token: %v %v", r, err)
	}
}

func TestDuplicateServerRefusedBeforeAuth(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	var reviews int
	var mu sync.Mutex
	e := newEnv(t, func(c *Config) {
		c.AuthenticateAgent = func(context.Context, AgentCredentials) error {
			mu.Lock()
			reviews++
			mu.Unlock()
			return nil
		}
	})
	c, err := tls.Dial("tcp", e.AgentAddr, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1", Certificates: []tls.Certificate{e.PKI.AgentCert}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	wire.WriteHello(c, "127.0.0.1", wire.AgentHello{ID: "x", Connected: []string{"other", "s1"}})
	_, err = wire.ReadReply(tunneltest.BufioReader(c))
	if wire.StatusCode(err) != http.StatusConflict {
		t.Fatalf("got %v, want 409", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if reviews != 0 {
		t.Fatalf("%d authentications for a duplicate", reviews)
	}
}

// Shutdown lets an open tunnel finish, refuses new work, then returns.
func TestGracefulShutdown(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)
	conn, br, resp := e.Connect(echo)
	defer conn.Close()
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done <- e.srv.Shutdown(ctx)
	}()
	tunneltest.WaitUntil(t, e.srv.isShutting, "the server shutting down")
	// The open tunnel still works during the drain.
	io.WriteString(conn, "still here")
	got := make([]byte, 10)
	if _, err := io.ReadFull(br, got); err != nil || string(got) != "still here" {
		t.Fatalf("tunnel during drain: %q %v", got, err)
	}
	conn.(*net.UnixConn).CloseWrite()
	io.Copy(io.Discard, br)
	if err := <-done; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
}

// The agent's drain: SIGTERM-equivalent lets open tunnels finish.
func TestAgentDrain(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	a := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)
	conn, br, resp := e.Connect(echo)
	defer conn.Close()
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	a.Cancel() // begin draining
	tunneltest.WaitUntil(t, func() bool { return agentDraining(e.srv, "a1") }, "the server saw the agent drain")
	io.WriteString(conn, "drain")
	got := make([]byte, 5)
	if _, err := io.ReadFull(br, got); err != nil || string(got) != "drain" {
		t.Fatalf("tunnel during agent drain: %q %v", got, err)
	}
	conn.(*net.UnixConn).CloseWrite()
	io.Copy(io.Discard, br)
	select {
	case <-a.Done:
	case <-time.After(5 * time.Second):
		t.Fatal("agent did not stop after its tunnel ended")
	}
}

// A client that sends, then closes its socket completely, while the
// destination never answers: the tunnel must not linger on either side.
func TestClientGoneWhileDestinationSilent(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	a := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	stop := make(chan struct{})
	dest := tunneltest.ServeTCP(t, func(c net.Conn) { <-stop }) // accepts, never reads or answers
	t.Cleanup(func() { close(stop) })
	conn, _, resp := e.Connect(dest)
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	io.WriteString(conn, "hello")
	tunneltest.WaitUntil(t, func() bool { return a.Stats.Tunnels.Load() == 1 }, "tunnel open at the agent")
	conn.Close()
	tunneltest.WaitUntil(t, func() bool { return a.Stats.Tunnels.Load() == 0 && frontOpen(e.srv) == 0 },
		"tunnel closed at the agent and the server after the client went away")
}

// An agent told to stop while a tunnel is half-closed towards a silent
// destination still stops once its drain timeout has passed.
func TestAgentStopsWithSilentDestination(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	a := e.startAgent("a1", "", func(c *agent.Config) { c.DrainTimeout = 300 * time.Millisecond })
	e.WaitAgents(1)
	stop := make(chan struct{})
	halfClosed := make(chan struct{})
	dest := tunneltest.ServeTCP(t, func(c net.Conn) {
		io.Copy(io.Discard, c) // until the client's half-close arrives
		close(halfClosed)
		<-stop
	})
	t.Cleanup(func() { close(stop) })
	conn, _, resp := e.Connect(dest)
	defer conn.Close()
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	conn.(*net.UnixConn).CloseWrite() // half-closed: the client still waits for an answer
	select {
	case <-halfClosed:
	case <-time.After(10 * time.Second):
		t.Fatal("the half-close never reached the destination")
	}
	a.Cancel()
	select {
	case <-a.Done:
	case <-time.After(5 * time.Second):
		t.Fatal("agent did not stop after its drain timeout")
	}
}

// A panic in one tunnel's code ends that tunnel only, on either side.
func TestPanicsEndOnlyTheirTunnel(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	m := promtext.NewRegistry()
	var frontendPanics atomic.Bool
	e := newEnv(t, func(c *Config) {
		c.Metrics = m
		c.CheckFrontendPeer = func(conn net.Conn) error {
			if _, ok := conn.(*net.UnixConn); ok && frontendPanics.Load() {
				panic("test: frontend bug")
			}
			return nil
		}
	})
	agentMetrics := promtext.NewRegistry()
	e.startAgent("a1", "", func(c *agent.Config) {
		c.Metrics = agentMetrics
		c.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if strings.HasSuffix(addr, ":7") {
				panic("test: agent bug")
			}
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		}
	})
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)

	conn, _, resp := e.Connect("127.0.0.1:7")
	conn.Close()
	if resp.StatusCode == 200 {
		t.Fatal("a panicking dial answered 200")
	}
	frontendPanics.Store(true)
	c, err := net.Dial("unix", e.UDS)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\n\r\n", echo)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	io.Copy(io.Discard, c) // the server closes it
	c.Close()
	frontendPanics.Store(false)

	conn, _, resp = e.Connect(echo)
	conn.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("after the panics: %s", resp.Status)
	}
	var b strings.Builder
	m.WriteText(&b)
	agentMetrics.WriteText(&b)
	for _, want := range []string{"konnectivity_network_proxy_server_panics_total 1\n", "konnectivity_network_proxy_agent_panics_total 1\n"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}
