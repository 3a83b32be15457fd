package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"
)

// An agent that speaks upstream's agent protocol with upstream's own
// libraries (grpc-go and konnectivity-client's Packet types), so that the
// server's gRPC agent side is checked against the real encoders rather
// than against the project's own codec.

// upstreamStyleAgent behaves as upstream's proxy-agent does: one
// /AgentService/Connect stream; a DIAL_REQ is dialled and answered with a
// DIAL_RSP carrying a new connect ID (or the dial's error); DATA moves
// both ways; CLOSE_REQ closes the destination and is answered with
// CLOSE_RSP; a destination that ends is reported with an unsolicited
// CLOSE_RSP.
type upstreamStyleAgent struct {
	id     string
	conn   *grpc.ClientConn
	stream grpc.ClientStream
	header metadata.MD
	cancel context.CancelFunc
	wg     sync.WaitGroup // receive loop and every endpoint goroutine
	recvWG sync.WaitGroup // the receive loop only

	sendMu sync.Mutex // grpc-go allows one SendMsg at a time

	nextID       atomic.Int64
	dialsOK      atomic.Int64
	dialsFailed  atomic.Int64
	closeReqs    atomic.Int64
	closeRspSent atomic.Int64
	dialCls      atomic.Int64

	mu         sync.Mutex
	holdAddr   string        // dials to this address wait for hold
	reuseID    int64         // when set, every dial is answered with this connect ID (a faulty agent)
	hold       chan struct{} // closed to let a held dial go on
	endpoints  map[int64]*upstreamEndpoint
	hosts      map[string]int // successful dials by destination host
	violations []string       // packets upstream's agent would not expect
	unknownIDs int            // DATA/CLOSE_REQ for a connect ID it does not hold
	recvErr    error
}

// upstreamEndpoint is one destination connection of the agent.
type upstreamEndpoint struct {
	c    net.Conn
	data chan []byte   // DATA towards the destination, in order
	done chan struct{} // closed once the endpoint is gone
	once sync.Once
}

func (e *upstreamEndpoint) end() {
	e.once.Do(func() {
		close(e.done)
		e.c.Close()
	})
}

// upstreamTLS is the agent's TLS configuration: trust p's CA, present p's
// agent client certificate (or none when cert is false). grpc-go adds
// ALPN h2 itself.
func upstreamTLS(t *testing.T, p *pki, cert bool) *tls.Config {
	t.Helper()
	caPEM, err := os.ReadFile(p.caCert)
	if err != nil {
		t.Fatalf("read CA: %v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		t.Fatalf("no certificate in %s", p.caCert)
	}
	cfg := &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
	if cert {
		pair, err := tls.LoadX509KeyPair(p.agentCert, p.agentKey)
		if err != nil {
			t.Fatalf("load agent key pair: %v", err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg
}

// connectUpstreamAgent opens the agent's stream to the agent port and
// starts serving it. An error is the server's refusal (or a transport
// failure); the agent is stopped by t's cleanup.
func connectUpstreamAgent(t *testing.T, port int, tlsCfg *tls.Config, id, identifiers, token string) (*upstreamStyleAgent, error) {
	t.Helper()
	conn, err := grpc.NewClient("127.0.0.1:"+strconv.Itoa(port),
		grpc.WithTransportCredentials(credentials.NewTLS(tlsCfg)))
	if err != nil {
		return nil, fmt.Errorf("grpc.NewClient: %w", err)
	}
	md := []string{"agentid", id, "agentidentifiers", identifiers}
	if token != "" {
		md = append(md, "authorization", "Bearer "+token)
	}
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(context.Background(), md...))
	a := &upstreamStyleAgent{
		id:        id,
		conn:      conn,
		cancel:    cancel,
		endpoints: map[int64]*upstreamEndpoint{},
		hosts:     map[string]int{},
	}
	t.Cleanup(a.stop)

	// Bound the stream's setup: a server that never answers must not
	// hang the test.
	setup := time.AfterFunc(startTimeout, cancel)
	defer setup.Stop()
	a.stream, err = conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, "/AgentService/Connect")
	if err != nil {
		return nil, fmt.Errorf("open /AgentService/Connect: %w", err)
	}
	a.header, err = a.stream.Header()
	if err != nil {
		return nil, fmt.Errorf("stream header: %w", err)
	}
	if len(a.header.Get("serverid")) == 0 {
		// A refusal is a trailers-only response: the status comes with
		// the first receive.
		err := a.stream.RecvMsg(&client.Packet{})
		if err == nil {
			err = errors.New("server sent a packet without the serverid header")
		}
		return nil, fmt.Errorf("stream without serverid header (header %v): %w", a.header, err)
	}
	a.wg.Add(1)
	a.recvWG.Add(1)
	go a.recvLoop()
	return a, nil
}

// stop ends the stream and every destination connection and waits for
// all of the agent's goroutines.
func (a *upstreamStyleAgent) stop() {
	a.cancel()
	if a.stream != nil {
		a.recvWG.Wait()
	}
	a.mu.Lock()
	eps := a.endpoints
	a.endpoints = map[int64]*upstreamEndpoint{}
	a.mu.Unlock()
	for _, e := range eps {
		e.end()
	}
	a.wg.Wait()
	a.conn.Close()
}

func (a *upstreamStyleAgent) send(p *client.Packet) error {
	a.sendMu.Lock()
	defer a.sendMu.Unlock()
	return a.stream.SendMsg(p)
}

func (a *upstreamStyleAgent) violation(format string, args ...any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.violations) < 10 {
		a.violations = append(a.violations, fmt.Sprintf(format, args...))
	}
}

func (a *upstreamStyleAgent) recvLoop() {
	defer a.wg.Done()
	defer a.recvWG.Done()
	for {
		p := &client.Packet{}
		if err := a.stream.RecvMsg(p); err != nil {
			a.mu.Lock()
			a.recvErr = err
			a.mu.Unlock()
			return
		}
		switch p.GetType() {
		case client.PacketType_DIAL_REQ:
			req := p.GetDialRequest()
			if req.GetProtocol() != "tcp" || req.GetRandom() == 0 {
				a.violation("DIAL_REQ protocol %q random %d", req.GetProtocol(), req.GetRandom())
			}
			// Upstream's agent dials off the receive loop, so one slow
			// destination does not hold up the others.
			a.wg.Add(1)
			go func() {
				defer a.wg.Done()
				a.dial(req.GetAddress(), req.GetRandom())
			}()
		case client.PacketType_DATA:
			d := p.GetData()
			e := a.endpoint(d.GetConnectID())
			if e == nil {
				a.mu.Lock()
				a.unknownIDs++
				a.mu.Unlock()
				_ = a.send(closeRsp(d.GetConnectID(), "unrecognized connectID"))
				continue
			}
			select {
			case e.data <- d.GetData():
			case <-e.done:
			}
		case client.PacketType_CLOSE_REQ:
			a.closeReqs.Add(1)
			id := p.GetCloseRequest().GetConnectID()
			e := a.take(id)
			if e == nil {
				a.mu.Lock()
				a.unknownIDs++
				a.mu.Unlock()
				_ = a.send(closeRsp(id, "unrecognized connectID"))
				continue
			}
			e.end()
			if a.send(closeRsp(id, "")) == nil {
				a.closeRspSent.Add(1)
			}
		case client.PacketType_DIAL_CLS:
			a.dialCls.Add(1)
		default:
			a.violation("unexpected %v from the server", p.GetType())
		}
	}
}

func closeRsp(id int64, errText string) *client.Packet {
	return &client.Packet{
		Type:    client.PacketType_CLOSE_RSP,
		Payload: &client.Packet_CloseResponse{CloseResponse: &client.CloseResponse{ConnectID: id, Error: errText}},
	}
}

func (a *upstreamStyleAgent) endpoint(id int64) *upstreamEndpoint {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.endpoints[id]
}

// take removes endpoint id; only the caller that took it reports its end.
func (a *upstreamStyleAgent) take(id int64) *upstreamEndpoint {
	a.mu.Lock()
	defer a.mu.Unlock()
	e := a.endpoints[id]
	delete(a.endpoints, id)
	return e
}

// holdDials makes dials to addr wait until the returned func is called.
func (a *upstreamStyleAgent) holdDials(addr string) (release func()) {
	ch := make(chan struct{})
	a.mu.Lock()
	a.holdAddr, a.hold = addr, ch
	a.mu.Unlock()
	var once sync.Once
	return func() { once.Do(func() { close(ch) }) }
}

func (a *upstreamStyleAgent) dial(addr string, random int64) {
	a.mu.Lock()
	hold := a.hold
	if addr != a.holdAddr {
		hold = nil
	}
	a.mu.Unlock()
	if hold != nil {
		<-hold
	}
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		a.dialsFailed.Add(1)
		_ = a.send(&client.Packet{
			Type:    client.PacketType_DIAL_RSP,
			Payload: &client.Packet_DialResponse{DialResponse: &client.DialResponse{Random: random, Error: err.Error()}},
		})
		return
	}
	id := a.nextID.Add(1)
	e := &upstreamEndpoint{c: c, data: make(chan []byte, 8), done: make(chan struct{})}
	host, _, _ := net.SplitHostPort(addr)
	a.mu.Lock()
	if a.recvErr != nil {
		a.mu.Unlock()
		c.Close()
		return
	}
	if a.reuseID != 0 {
		id = a.reuseID
		if a.endpoints[id] != nil {
			// The ID's first destination keeps it; this one is dropped.
			a.mu.Unlock()
			c.Close()
			a.dialsOK.Add(1)
			_ = a.send(&client.Packet{
				Type:    client.PacketType_DIAL_RSP,
				Payload: &client.Packet_DialResponse{DialResponse: &client.DialResponse{Random: random, ConnectID: id}},
			})
			return
		}
	}
	// Registered before DIAL_RSP goes out: DATA may follow it at once.
	a.endpoints[id] = e
	a.hosts[host]++
	a.mu.Unlock()
	a.dialsOK.Add(1)
	if err := a.send(&client.Packet{
		Type:    client.PacketType_DIAL_RSP,
		Payload: &client.Packet_DialResponse{DialResponse: &client.DialResponse{Random: random, ConnectID: id}},
	}); err != nil {
		a.take(id)
		e.end()
		return
	}
	a.wg.Add(2)
	go func() { // server → destination
		defer a.wg.Done()
		for {
			select {
			case b := <-e.data:
				if _, err := c.Write(b); err != nil {
					c.Close() // the reader below reports the end
					return
				}
			case <-e.done:
				return
			}
		}
	}()
	go func() { // destination → server
		defer a.wg.Done()
		buf := make([]byte, 32<<10)
		for {
			n, err := c.Read(buf)
			if n > 0 {
				pkt := &client.Packet{
					Type:    client.PacketType_DATA,
					Payload: &client.Packet_Data{Data: &client.Data{ConnectID: id, Data: append([]byte(nil), buf[:n]...)}},
				}
				if a.send(pkt) != nil {
					e.end()
					return
				}
			}
			if err != nil {
				// The destination ended (not a CLOSE_REQ, which takes
				// the endpoint first): tell the server unasked.
				if a.take(id) != nil {
					e.end()
					if a.send(closeRsp(id, "")) == nil {
						a.closeRspSent.Add(1)
					}
				}
				return
			}
		}
	}()
}

func (a *upstreamStyleAgent) open() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.endpoints)
}

func (a *upstreamStyleAgent) dialsTo(host string) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.hosts[host]
}

// checkClean fails t if the server sent anything upstream's agent would
// not expect, or if the stream ended.
func (a *upstreamStyleAgent) checkClean(t *testing.T) {
	t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.violations) > 0 {
		t.Errorf("upstream-style agent %s saw protocol violations: %s", a.id, strings.Join(a.violations, "; "))
	}
	if a.recvErr != nil {
		t.Errorf("upstream-style agent %s: stream ended: %v", a.id, a.recvErr)
	}
}

// ---------------------------------------------------------------------------

// TestUpstreamAgent: an agent built on grpc-go and konnectivity-client's
// Packet types, as upstream's proxy-agent is, connected beside one of our
// agents to the same agent port; kube-apiserver's egress dialer reaches
// backends through each, routed by --proxy-strategies=destHost,default.
func TestUpstreamAgent(t *testing.T) {
	if err := canListen("127.0.0.2", "127.0.0.3"); err != nil {
		t.Skipf("cannot listen on 127.0.0.2/127.0.0.3 (needs all of 127/8 on loopback, as on Linux): %v", err)
	}
	const serverID = "e2e-upstream-s1"
	s := startServer(t, "--proxy-strategies=destHost,default", "--server-id="+serverID, "--server-count=1")
	ours := s.startAgent(t, "ours", "ipv4=127.0.0.3")
	up, err := connectUpstreamAgent(t, s.agentPort, upstreamTLS(t, s.pki, true), "upstream-1", "ipv4=127.0.0.2", "")
	if err != nil {
		t.Fatalf("upstream-style agent: %v", err)
	}
	if got := up.header.Get("serverid"); len(got) != 1 || got[0] != serverID {
		t.Errorf("serverid header %q, want [%q]", got, serverID)
	}
	if got := up.header.Get("servercount"); len(got) != 1 || got[0] != "1" {
		t.Errorf("servercount header %q, want [\"1\"]", got)
	}
	s.waitAgents(t, 2, startTimeout)

	bUp := startHTTPBackend(t, "127.0.0.2", "up")
	bOurs := startHTTPBackend(t, "127.0.0.3", "ours")
	d := s.egressDialer(t)
	oursMetrics := ours.healthURL("/metrics")
	oursDials := func() int64 { return int64(metricValue(t, oursMetrics, agtPrefix+"dial_duration_seconds")) }

	// carried checks that exactly wantUp dials went through the
	// upstream-style agent and wantOurs through ours since the marks.
	carried := func(t *testing.T, upBefore, oursBefore, wantUp, wantOurs int64) {
		t.Helper()
		if got := up.dialsOK.Load() - upBefore; got != wantUp {
			t.Errorf("upstream-style agent dialled %d, want %d", got, wantUp)
		}
		if got := oursDials() - oursBefore; got != wantOurs {
			t.Errorf("our agent dialled %d, want %d", got, wantOurs)
		}
	}

	t.Run("sequential", func(t *testing.T) {
		upBefore, oursBefore := up.dialsOK.Load(), oursDials()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var tunnels int64counter
		client := d.httpClient(false, &tunnels)
		const n = 50
		for i := range n {
			for _, b := range []struct{ addr, name string }{{bUp, "up"}, {bOurs, "ours"}} {
				if err := getHello(ctx, client, b.addr, b.name, i); err != nil {
					t.Fatalf("request %d to %s: %v", i, b.name, err)
				}
			}
		}
		if got := tunnels.get(); got != 2*n {
			t.Errorf("tunnels = %d, want %d", got, 2*n)
		}
		carried(t, upBefore, oursBefore, n, n)
	})

	t.Run("concurrent", func(t *testing.T) {
		upBefore, oursBefore := up.dialsOK.Load(), oursDials()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		client := d.httpClient(false, nil)
		const n = 40 // per backend, all at once
		errs := make(chan error, 2*n)
		var wg sync.WaitGroup
		for i := range n {
			for _, b := range []struct{ addr, name string }{{bUp, "up"}, {bOurs, "ours"}} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					if err := getHello(ctx, client, b.addr, b.name, i); err != nil {
						errs <- fmt.Errorf("request %d to %s: %w", i, b.name, err)
					}
				}()
			}
		}
		wg.Wait()
		close(errs)
		failed := 0
		for err := range errs {
			if failed++; failed <= 5 {
				t.Error(err)
			}
		}
		if failed > 0 {
			t.Fatalf("%d of %d concurrent requests failed", failed, 2*n)
		}
		carried(t, upBefore, oursBefore, n, n)
	})

	t.Run("keepalive-and-large-bodies", func(t *testing.T) {
		upBefore, oursBefore := up.dialsOK.Load(), oursDials()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var tunnels int64counter
		client := d.httpClient(true, &tunnels)
		defer client.CloseIdleConnections()
		for i := range 20 {
			if err := getHello(ctx, client, bUp, "up", i); err != nil {
				t.Fatalf("keep-alive request %d: %v", i, err)
			}
		}
		// Many DATA packets each way on the same tunnel.
		const size = 4 << 20
		body, err := get(ctx, client, fmt.Sprintf("http://%s/big?n=%d", bUp, size))
		if err != nil {
			t.Fatalf("download: %v", err)
		}
		if len(body) != size || sha([]byte(body)) != sha(pattern(size)) {
			t.Fatalf("download: %d bytes sha %s, want %d bytes sha %s", len(body), sha([]byte(body)), size, sha(pattern(size)))
		}
		upload := pattern(2 << 20)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+bUp+"/echo", strings.NewReader(string(upload)))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("upload: %v", err)
		}
		echoed, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || sha(echoed) != sha(upload) {
			t.Fatalf("upload: echoed %d bytes sha %s (err %v), want %d bytes sha %s", len(echoed), sha(echoed), err, len(upload), sha(upload))
		}
		if got := tunnels.get(); got != 1 {
			t.Errorf("tunnels = %d, want 1 (keep-alive)", got)
		}
		carried(t, upBefore, oursBefore, 1, 0)
	})

	t.Run("dial-failure", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.2:0")
		if err != nil {
			t.Fatal(err)
		}
		closed := l.Addr().String()
		l.Close()
		failedBefore, oursBefore := up.dialsFailed.Load(), oursDials()
		el, err := dialErr(t, d, closed, 10*time.Second)
		if err == nil {
			t.Fatalf("dial to closed port %s succeeded", closed)
		}
		if !strings.Contains(err.Error(), "code 502") {
			t.Fatalf("egress dial to closed port %s: %q after %v, want \"code 502\"", closed, err, el)
		}
		// The egress dialer shows only the status line; the agent's
		// text is in the body, as a raw CONNECT shows.
		c, _, code, body, cerr := faultConnect(s.sock, closed, 10*time.Second)
		if c != nil {
			c.Close()
		}
		if cerr != nil || code != http.StatusBadGateway || !strings.Contains(body, "upstream-1") || !strings.Contains(body, "connection refused") {
			t.Fatalf("CONNECT to closed port %s: status %d body %q err %v, want 502 naming upstream-1 with \"connection refused\"", closed, code, body, cerr)
		}
		t.Logf("closed port via upstream-style agent: egress dialer %q; CONNECT body %q", err, body)
		if got := up.dialsFailed.Load() - failedBefore; got != 2 {
			t.Errorf("upstream-style agent failed dials = %d, want 2", got)
		}
		if got := oursDials() - oursBefore; got != 0 {
			t.Errorf("our agent dialled %d for a 127.0.0.2 destination, want 0", got)
		}
		// The agent stays usable after a failed dial.
		checkReachable(t, d, bUp, "up", 3)
	})

	t.Run("default-strategy", func(t *testing.T) {
		// 127.0.0.1 matches neither agent's identifiers: either may carry it.
		bAny := startHTTPBackend(t, "127.0.0.1", "any")
		upBefore, oursBefore := up.dialsOK.Load(), oursDials()
		const n = 20
		checkReachable(t, d, bAny, "any", n)
		gotUp, gotOurs := up.dialsOK.Load()-upBefore, oursDials()-oursBefore
		if gotUp+gotOurs != n {
			t.Errorf("dials: upstream-style %d + ours %d, want %d in all", gotUp, gotOurs, n)
		}
		t.Logf("default strategy: %d via upstream-style agent, %d via ours", gotUp, gotOurs)
	})

	t.Run("client-closes", func(t *testing.T) {
		// A backend that never closes first: the client's close must
		// reach the agent as CLOSE_REQ, which closes the destination.
		echo := startTCPBackend(t, "127.0.0.2", echoHandler)
		reqsBefore := up.closeReqs.Load()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		const n = 5
		for i := range n {
			c, err := d.bounded()(ctx, "tcp", echo.addr())
			if err != nil {
				t.Fatalf("dial echo %d: %v", i, err)
			}
			if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
				t.Fatal(err)
			}
			br := bufio.NewReader(c)
			for j := range 10 {
				if err := echoOnce(c, br, fmt.Sprintf("ping %d %d\n", i, j)); err != nil {
					t.Fatalf("echo %d/%d: %v", i, j, err)
				}
			}
			c.Close()
		}
		waitFor(t, 10*time.Second, "echo backend's connections closed by the agent", func() bool { return echo.active() == 0 })
		if got := up.closeReqs.Load() - reqsBefore; got < n {
			t.Errorf("agent got %d CLOSE_REQ for %d client-closed tunnels", got, n)
		}
	})

	t.Run("late-dial-response", func(t *testing.T) {
		// The agent answers after --backend-dial-timeout (3s): the client
		// gets 504, the server sends DIAL_CLS, and the connection the
		// agent makes afterwards is closed with CLOSE_REQ.
		echo := startTCPBackend(t, "127.0.0.2", echoHandler)
		release := up.holdDials(echo.addr())
		defer release()
		clsBefore, reqsBefore, okBefore := up.dialCls.Load(), up.closeReqs.Load(), up.dialsOK.Load()
		el, err := dialErr(t, d, echo.addr(), 15*time.Second)
		if err == nil || !strings.Contains(err.Error(), "code 504") {
			t.Fatalf("dial the agent does not answer: %v after %v, want \"code 504\"", err, el)
		}
		waitFor(t, 5*time.Second, "DIAL_CLS for the abandoned dial", func() bool { return up.dialCls.Load() > clsBefore })
		release()
		waitFor(t, 10*time.Second, "late connection dialled, then closed by CLOSE_REQ", func() bool {
			return up.dialsOK.Load() > okBefore && up.closeReqs.Load() > reqsBefore && up.open() == 0 && echo.active() == 0
		})
		checkReachable(t, d, bUp, "up", 3)
	})

	t.Run("tunnels-closed", func(t *testing.T) {
		// Every tunnel ended with the HTTP exchange (backend close →
		// unsolicited CLOSE_RSP, or client close → CLOSE_REQ): none stays
		// open at the agent.
		waitFor(t, 10*time.Second, "upstream-style agent's endpoints all closed", func() bool { return up.open() == 0 })
		if got, want := up.dialsTo("127.0.0.2"), int(up.dialsOK.Load())-up.dialsTo("127.0.0.1"); got != want {
			t.Errorf("upstream-style agent dialled 127.0.0.2 %d times of %d non-default dials", got, want)
		}
		if n := up.dialsTo("127.0.0.3"); n != 0 {
			t.Errorf("upstream-style agent dialled 127.0.0.3 (our agent's identifier) %d times", n)
		}
		up.mu.Lock()
		unknown := up.unknownIDs
		up.mu.Unlock()
		t.Logf("upstream-style agent: %d dials ok, %d failed, %d CLOSE_REQ (%d for an already closed ID), %d CLOSE_RSP sent, %d DIAL_CLS",
			up.dialsOK.Load(), up.dialsFailed.Load(), up.closeReqs.Load(), unknown, up.closeRspSent.Load(), up.dialCls.Load())
		up.checkClean(t)
	})

	t.Run("agent-gone", func(t *testing.T) {
		// A tunnel open through the agent when it disconnects ends at
		// once for the client; new dials go to the remaining agent.
		echo := startTCPBackend(t, "127.0.0.2", echoHandler)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := d.bounded()(ctx, "tcp", echo.addr())
		if err != nil {
			t.Fatalf("dial echo: %v", err)
		}
		defer c.Close()
		if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(c)
		if err := echoOnce(c, br, "before\n"); err != nil {
			t.Fatalf("echo before the agent left: %v", err)
		}
		up.stop()
		if _, err := br.ReadString('\n'); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("tunnel through the departed agent: read %v, want it ended at once", err)
		}
		s.waitAgents(t, 1, startTimeout)
		oursBefore := oursDials()
		checkReachable(t, d, bUp, "up", 5) // no identifier matches now: default → ours
		if got := oursDials() - oursBefore; got != 5 {
			t.Errorf("our agent dialled %d after the upstream-style agent left, want 5", got)
		}
	})
}

// TestUpstreamAgentTokenAuth: an upstream-style agent without a client
// certificate authenticates with a ServiceAccount token in the
// authorization metadata, as upstream's agent does; a bad token is
// refused with Unauthenticated.
func TestUpstreamAgentTokenAuth(t *testing.T) {
	p := newPKI(t, t.TempDir())
	api := startFakeAPIServer(t, p)
	s := startTokenServer(t, p, api, t.TempDir())
	noCert := upstreamTLS(t, p, false)

	_, err := connectUpstreamAgent(t, s.agentPort, noCert, "bad-token", "", "bad-token")
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("bad token: %v, want code Unauthenticated", err)
	}
	t.Logf("bad token refused: %v", err)
	_, err = connectUpstreamAgent(t, s.agentPort, noCert, "no-token", "", "")
	if err == nil {
		t.Fatal("agent with neither certificate nor token admitted")
	}
	t.Logf("no credentials refused: %v", err)
	if got := getStatus(t, s.healthURL("/readyz")); got != http.StatusServiceUnavailable {
		t.Fatalf("/readyz = %d with only refused agents, want 503", got)
	}

	up, err := connectUpstreamAgent(t, s.agentPort, noCert, "token-agent", "", goodToken)
	if err != nil {
		t.Fatalf("good token: %v", err)
	}
	defer up.checkClean(t)
	s.waitAgents(t, 1, startTimeout)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	checkReachable(t, s.egressDialer(t), backend, "b1", 10)
	if got := up.dialsOK.Load(); got != 10 {
		t.Errorf("token-authenticated agent dialled %d, want 10", got)
	}
}

// An upstream-protocol agent that answers a second dial with the connect
// ID of a tunnel that is open: the second dial fails and the first tunnel
// goes on; once the agent leaves, the first tunnel ends too instead of
// staying open with nothing behind it.
func TestUpstreamAgentConnectIDInUse(t *testing.T) {
	s := startServer(t)
	up, err := connectUpstreamAgent(t, s.agentPort, upstreamTLS(t, s.pki, true), "upstream-1", "", "")
	if err != nil {
		t.Fatalf("upstream-style agent: %v", err)
	}
	up.mu.Lock()
	up.reuseID = 7
	up.mu.Unlock()
	s.waitAgents(t, 1, startTimeout)
	echo := startTCPBackend(t, "127.0.0.1", func(c net.Conn) { io.Copy(c, c) })
	d := s.egressDialer(t).bounded()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	first, err := d(ctx, "tcp", echo.addr())
	if err != nil {
		t.Fatalf("first dial: %v", err)
	}
	defer first.Close()
	if second, err := d(ctx, "tcp", echo.addr()); err == nil {
		defer second.Close()
		t.Error("a dial answered with the connect ID of an open tunnel succeeded")
	} else {
		t.Logf("second dial, answered with the first's connect ID: %v", err)
	}
	first.SetDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(first)
	if err := echoOnce(first, br, "ping\n"); err != nil {
		t.Errorf("the first tunnel after the second dial: %v", err)
	}
	first.SetDeadline(time.Now().Add(10 * time.Second))

	up.stop()
	s.waitAgents(t, 0, startTimeout)
	start := time.Now()
	if _, err := io.Copy(io.Discard, br); err != nil {
		t.Fatalf("the first tunnel, %v after its agent left: %v (still open)", time.Since(start).Round(time.Millisecond), err)
	}
	t.Logf("the first tunnel ended %v after its agent left", time.Since(start).Round(time.Millisecond))
}
