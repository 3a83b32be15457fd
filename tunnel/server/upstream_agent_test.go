//lint:file-ignore SA1019 the fake upstream agent uses x/net/http2's Transport on a TLS connection it dialled, as grpc-go would.

package server

import (
	"context"
	"crypto/tls"
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

	"golang.org/x/net/http2"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// fakeUpstreamAgent behaves as upstream's proxy-agent does on the wire:
// gRPC over TLS with ALPN h2, one /AgentService/Connect stream, DIAL_REQ
// answered by a dial, DATA both ways, CLOSE_REQ answered by CLOSE_RSP.
type fakeUpstreamAgent struct {
	t      *testing.T
	send   *io.PipeWriter
	sendMu sync.Mutex
	resp   *http.Response
	cancel context.CancelFunc
	leave  func() // ends the stream and the connection; again, nothing
	wg     sync.WaitGroup

	mu      sync.Mutex
	conns   map[int64]net.Conn
	nextID  int64
	dials   int
	reuseID int64 // when set, every dial is answered with this connect ID
}

func startFakeUpstreamAgent(t *testing.T, e *env, id, identifiers string) *fakeUpstreamAgent {
	t.Helper()
	return startFakeUpstreamAgentALPN(t, e, id, identifiers, []string{"h2"}, "h2")
}

// startFakeUpstreamAgentALPN is startFakeUpstreamAgent offering protos
// (upstream's --alpn-proto), and checking that ALPN settled on want.
func startFakeUpstreamAgentALPN(t *testing.T, e *env, id, identifiers string, protos []string, want string) *fakeUpstreamAgent {
	t.Helper()
	raw, err := net.Dial("tcp", e.AgentAddr)
	if err != nil {
		t.Fatal(err)
	}
	tc := tls.Client(raw, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1", Certificates: []tls.Certificate{e.PKI.AgentCert}, NextProtos: protos})
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	if p := tc.ConnectionState().NegotiatedProtocol; p != want {
		t.Fatalf("ALPN negotiated %q, want %q", p, want)
	}
	cc, err := (&http2.Transport{}).NewClientConn(tc)
	if err != nil {
		t.Fatal(err)
	}
	pr, pw := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "https://server"+agentConnectMethod, pr)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("agentid", id)
	req.Header.Set("agentidentifiers", identifiers)
	resp, err := cc.RoundTrip(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if resp.Header.Get("serverid") != "s1" || resp.Header.Get("servercount") != "1" {
		t.Fatalf("response headers %v", resp.Header)
	}
	f := &fakeUpstreamAgent{t: t, send: pw, resp: resp, cancel: cancel, conns: map[int64]net.Conn{}}
	f.leave = sync.OnceFunc(func() {
		cancel()
		pw.Close()
		resp.Body.Close()
		cc.Close()
	})
	f.wg.Add(1)
	go f.loop()
	t.Cleanup(func() {
		f.leave()
		f.mu.Lock()
		for _, c := range f.conns {
			c.Close()
		}
		f.mu.Unlock()
		f.wg.Wait()
	})
	return f
}

func (f *fakeUpstreamAgent) write(p grpcwire.Packet) {
	f.sendMu.Lock()
	defer f.sendMu.Unlock()
	f.send.Write(grpcwire.AppendMessage(nil, p))
}

func (f *fakeUpstreamAgent) loop() {
	defer f.wg.Done()
	var buf []byte
	for {
		msg, nbuf, err := grpcwire.ReadMessage(f.resp.Body, buf, grpcwire.MaxMessageLen)
		buf = nbuf
		if err != nil {
			return
		}
		p, err := grpcwire.Decode(msg)
		if err != nil {
			f.t.Errorf("fake agent: %v", err)
			return
		}
		switch p.Type {
		case grpcwire.DialReq:
			c, err := net.DialTimeout("tcp", p.Address, 5*time.Second)
			if err != nil {
				f.write(grpcwire.Packet{Type: grpcwire.DialRsp, Random: p.Random, Error: err.Error()})
				continue
			}
			f.mu.Lock()
			f.nextID++
			id := f.nextID
			f.dials++
			reused := f.reuseID != 0 && f.conns[f.reuseID] != nil
			if f.reuseID != 0 {
				id = f.reuseID
			}
			if !reused {
				f.conns[id] = c
			}
			f.mu.Unlock()
			f.write(grpcwire.Packet{Type: grpcwire.DialRsp, Random: p.Random, ConnectID: id})
			if reused {
				c.Close() // the ID's first destination keeps it
				continue
			}
			f.wg.Add(1)
			go func() {
				defer f.wg.Done()
				b := make([]byte, 32<<10)
				for {
					n, err := c.Read(b)
					if n > 0 {
						f.write(grpcwire.Packet{Type: grpcwire.Data, ConnectID: id, Data: append([]byte(nil), b[:n]...)})
					}
					if err != nil {
						f.write(grpcwire.Packet{Type: grpcwire.CloseRsp, ConnectID: id})
						return
					}
				}
			}()
		case grpcwire.Data:
			f.mu.Lock()
			c := f.conns[p.ConnectID]
			f.mu.Unlock()
			if c != nil {
				c.Write(p.Data)
			}
		case grpcwire.CloseReq:
			f.mu.Lock()
			c := f.conns[p.ConnectID]
			delete(f.conns, p.ConnectID)
			f.mu.Unlock()
			if c != nil {
				c.Close()
			}
		}
	}
}

func (f *fakeUpstreamAgent) dialCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.dials
}

// An upstream agent and one of ours on the same agent port, both serving
// dials; the destHost strategy routes to either by identifiers.
func TestUpstreamAgentBesideOurs(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) { c.Strategies = []Strategy{StrategyDestHost, StrategyDefault} })
	up := startFakeUpstreamAgent(t, e, "upstream-1", "ipv4=127.0.0.1")
	ours := e.startAgent("ours", "host=localhost", nil)
	e.WaitAgents(2)
	echo := tunneltest.EchoServer(t)
	_, port, _ := net.SplitHostPort(echo)

	roundTrip := func(addr, msg string) {
		t.Helper()
		conn, br, resp := e.Connect(addr)
		defer conn.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %s", addr, resp.Status)
		}
		io.WriteString(conn, msg)
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(br, got); err != nil || string(got) != msg {
			t.Fatalf("%s: echo %q %v", addr, got, err)
		}
	}
	big := strings.Repeat("0123456789abcdef", 8<<10) // 128 KiB: several DATA packets
	for i := range 5 {
		roundTrip(net.JoinHostPort("127.0.0.1", port), big) // upstream agent (ipv4 identifier)
		roundTrip(net.JoinHostPort("localhost", port), "x") // ours (host identifier)
		_ = i
	}
	if up.dialCount() != 5 || ours.dialsOK() != 5 {
		t.Fatalf("routing: upstream %d, ours %d, want 5/5", up.dialCount(), ours.dialsOK())
	}
	// A failed dial through the upstream agent carries its error text.
	ours.Stop()
	e.WaitAgents(1)
	conn, br, resp := e.Connect("127.0.0.1:1")
	body, _ := io.ReadAll(br)
	conn.Close()
	if resp.StatusCode != 502 || !strings.Contains(string(body), "refused") {
		t.Fatalf("failed dial: %d %q", resp.StatusCode, body)
	}
}

// A tunnel through an upstream agent whose client stops reading stalls
// only that agent: dials through our agent keep flowing.
func TestUpstreamAgentStallIsolated(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) { c.Strategies = []Strategy{StrategyDestHost, StrategyDefault} })
	startFakeUpstreamAgent(t, e, "upstream-1", "ipv4=127.0.0.1")
	e.startAgent("ours", "host=localhost", nil)
	e.WaitAgents(2)
	var fired atomic.Int64
	firehose := tunneltest.ServeTCP(t, func(c net.Conn) {
		b := make([]byte, 64<<10)
		for {
			n, err := c.Write(b)
			fired.Add(int64(n))
			if err != nil {
				return
			}
		}
	})
	stalled, _, resp := e.Connect(firehose) // 127.0.0.1: upstream agent; never read
	defer stalled.Close()
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	tunneltest.WaitStalled(t, "the stalled tunnel's windows full", &fired)
	echo := tunneltest.EchoServer(t)
	_, port, _ := net.SplitHostPort(echo)
	conn, br, resp := e.Connect(net.JoinHostPort("localhost", port))
	defer conn.Close()
	if resp.StatusCode != 200 {
		t.Fatal(resp.Status)
	}
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	b := make([]byte, 8)
	for range 200 {
		io.WriteString(conn, "12345678")
		if _, err := io.ReadFull(br, b); err != nil {
			t.Fatalf("echo through our agent behind a stalled upstream agent: %v", err)
		}
	}
}

// On an agent port that accepts an extra ALPN protocol (--alpn-proto, for
// a port an ALPN router shares), ALPN no longer says which protocol a
// connection speaks: the first bytes do. Our agent and upstream's, both
// negotiating the extra protocol, are each served as they speak.
func TestAgentPortExtraALPN(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const proto = "x-konnectivity"
	e := newEnv(t, func(c *Config) {
		c.AgentTLS.NextProtos = []string{proto}
		c.Strategies = []Strategy{StrategyDestHost, StrategyDefault}
	})
	up := startFakeUpstreamAgentALPN(t, e, "upstream-1", "ipv4=127.0.0.1", []string{proto, "h2"}, proto)
	ours := e.startAgent("ours", "host=localhost", func(c *agent.Config) {
		tlsFor := c.TLS
		c.TLS = func(name string) (*tls.Config, error) {
			cfg, err := tlsFor(name)
			if cfg != nil {
				cfg.NextProtos = []string{proto}
			}
			return cfg, err
		}
	})
	e.WaitAgents(2)
	echo := tunneltest.EchoServer(t)
	_, port, _ := net.SplitHostPort(echo)
	for _, host := range []string{"127.0.0.1", "localhost"} {
		conn, br, resp := e.Connect(net.JoinHostPort(host, port))
		if resp.StatusCode != 200 {
			conn.Close()
			t.Fatalf("%s: %s", host, resp.Status)
		}
		io.WriteString(conn, "ping")
		got := make([]byte, 4)
		_, err := io.ReadFull(br, got)
		conn.Close()
		if err != nil || string(got) != "ping" {
			t.Fatalf("%s: echo %q %v", host, got, err)
		}
	}
	if up.dialCount() != 1 || ours.dialsOK() != 1 {
		t.Fatalf("routing: upstream %d, ours %d, want 1/1", up.dialCount(), ours.dialsOK())
	}
}

// An upstream agent's DRAIN packet is its drain: the server closes the
// agent's idle keep-alive tunnel at a quiet moment, at once.
func TestUpstreamAgentDrainClosesIdleTunnels(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	up := startFakeUpstreamAgent(t, e, "upstream-1", "")
	e.WaitAgents(1)
	idle := e.EchoOne(tunneltest.EchoServer(t))
	defer idle.Close()
	idle.SetDeadline(time.Time{})
	ended := make(chan time.Time, 1)
	go func() { io.Copy(io.Discard, idle); ended <- time.Now() }()
	time.Sleep(drainQuietLong) // idle since before the drain
	began := time.Now()
	up.write(grpcwire.Packet{Type: grpcwire.Drain})
	select {
	case at := <-ended:
		t.Logf("idle tunnel closed %v after the DRAIN packet", at.Sub(began))
	case <-time.After(10 * time.Second):
		t.Fatal("idle tunnel through a draining upstream agent never closed")
	}
	if e.srv.Stats.ClosedQuiet.Load() != 1 {
		t.Errorf("%d tunnels closed at a quiet moment, want the idle one", e.srv.Stats.ClosedQuiet.Load())
	}
	if !agentDraining(e.srv, "upstream-1") {
		t.Error("the server does not take the upstream agent for draining")
	}
}

// An upstream agent that answers a second dial with the connect ID of a
// tunnel that is open: the second dial fails (502) and the first tunnel
// goes on; once the agent leaves, the first tunnel ends too, and no
// handler waits on it.
func TestUpstreamAgentConnectIDInUse(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	up := startFakeUpstreamAgent(t, e, "upstream-1", "")
	up.mu.Lock()
	up.reuseID = 7
	up.mu.Unlock()
	e.WaitAgents(1)
	echo := tunneltest.EchoServer(t)

	first, br, resp := e.Connect(echo)
	defer first.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("first dial: %s", resp.Status)
	}
	second, br2, resp := e.Connect(echo)
	defer second.Close()
	if resp.StatusCode != 502 {
		t.Fatalf("second dial answered with the first's connect ID: %s, want 502", resp.Status)
	}
	body, _ := io.ReadAll(io.LimitReader(br2, 512))
	if !strings.Contains(string(body), "connect ID 7") {
		t.Fatalf("second dial answered with the first's connect ID: %s %q, want 502 naming the ID", resp.Status, body)
	}
	first.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(first, "ping")
	got := make([]byte, 4)
	if _, err := io.ReadFull(br, got); err != nil || string(got) != "ping" {
		t.Fatalf("the first tunnel after the second dial: echo %q, %v", got, err)
	}

	up.leave()
	e.WaitAgents(0)
	if _, err := io.Copy(io.Discard, br); err != nil {
		t.Fatalf("the first tunnel once its agent left: %v (still open)", err)
	}
}
