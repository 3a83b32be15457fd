package server

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/spinifex/konnectivity/auth"
	"github.com/spinifex/konnectivity/internal/kubeclient"
	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// Attacks on the agent port before admission (admission.go), from raw
// sockets: logins reset as soon as they are sent, connections that never
// log in, and more of them than the server lets wait. Each runs while a
// good agent joins and serves a dial.

// h2Peer is a raw HTTP/2 client on the agent port (TLS with ALPN h2, as
// upstream's agent), writing frames by hand.
type h2Peer struct {
	conn   *tls.Conn
	fr     *http2.Framer
	hbuf   bytes.Buffer
	enc    *hpack.Encoder
	closed chan struct{} // the server closed the connection (a read failed)
	start  time.Time     // when the TCP connection was made
	cutAt  time.Duration // when the read failed, valid after closed
}

// dialH2Peer connects without a client certificate, so that only a login
// can admit it; withPreface also sends the client preface and SETTINGS.
func dialH2Peer(t *testing.T, e *env, withPreface bool) *h2Peer {
	t.Helper()
	start := time.Now()
	raw, err := net.Dial("tcp", e.AgentAddr)
	if err != nil {
		t.Fatal(err)
	}
	c := tls.Client(raw, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1", NextProtos: []string{"h2"}})
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := c.Handshake(); err != nil {
		raw.Close()
		t.Fatal(err)
	}
	c.SetDeadline(time.Time{})
	p := &h2Peer{conn: c, fr: http2.NewFramer(c, c), closed: make(chan struct{}), start: start}
	p.enc = hpack.NewEncoder(&p.hbuf)
	if withPreface {
		io.WriteString(c, http2.ClientPreface)
		p.fr.WriteSettings()
	}
	// Read (and drop) whatever the server sends, so its writes never
	// block on us; the read fails when the server closes.
	go func() {
		defer close(p.closed)
		io.Copy(io.Discard, c)
		p.cutAt = time.Since(start)
	}()
	t.Cleanup(func() { c.Close(); <-p.closed })
	return p
}

// login sends HEADERS for /AgentService/Connect with token on stream id.
func (p *h2Peer) login(id uint32, agentID, token string, end bool) error {
	p.hbuf.Reset()
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "https"}, {":authority", "127.0.0.1"}, {":path", agentConnectMethod},
		{"content-type", "application/grpc"}, {"te", "trailers"}, {"agentid", agentID}, {"authorization", "Bearer " + token},
	} {
		p.enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	return p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: p.hbuf.Bytes(), EndHeaders: true, EndStream: end})
}

// waitClosed reports whether the server closed the connection within d.
func (p *h2Peer) waitClosed(d time.Duration) bool {
	select {
	case <-p.closed:
		return true
	case <-time.After(d):
		return false
	}
}

// fakeReviews is a kube-apiserver TokenReview endpoint that refuses every
// token after holding each call for hold (or until its client gives up),
// and counts calls and how many were in flight at once.
type fakeReviews struct {
	srv  *httptest.Server
	hold time.Duration

	calls, inFlight, maxInFlight, cancelled atomic.Int64
}

func newFakeReviews(t *testing.T, hold time.Duration) *fakeReviews {
	f := &fakeReviews{hold: hold}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.calls.Add(1)
		n := f.inFlight.Add(1)
		defer f.inFlight.Add(-1)
		for {
			m := f.maxInFlight.Load()
			if n <= m || f.maxInFlight.CompareAndSwap(m, n) {
				break
			}
		}
		select {
		case <-time.After(f.hold):
		case <-r.Context().Done():
			f.cancelled.Add(1)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"apiVersion":"authentication.k8s.io/v1","kind":"TokenReview","status":{"authenticated":false}}`)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

// reviewer is auth's TokenReviewer against f, as the server command sets it up.
func (f *fakeReviews) reviewer(t *testing.T) *auth.TokenReviewer {
	kc := fmt.Sprintf("apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: f\n  cluster: {server: %q}\ncontexts:\n- name: c\n  context: {cluster: f, user: u}\nusers:\n- name: u\n  user: {token: server-token}\n", f.srv.URL)
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	rc, err := kubeclient.LoadKubeconfig(path, "")
	if err != nil {
		t.Fatal(err)
	}
	r, err := auth.NewTokenReviewer(rc, auth.ReviewOptions{Audience: "a", Namespace: "kube-system", ServiceAccount: "konnectivity-agent", CacheTTL: -1})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// reviewCounter wraps an authenticator and counts the calls in flight, per
// agent ID (each attacking connection uses its own) and in all.
type reviewCounter struct {
	mu        sync.Mutex
	perID     map[string]int // guarded by mu
	maxPerID  int            // guarded by mu
	total     int            // guarded by mu
	now, peak atomic.Int64
}

func (rc *reviewCounter) wrap(next func(context.Context, AgentCredentials) error) func(context.Context, AgentCredentials) error {
	rc.perID = map[string]int{}
	return func(ctx context.Context, c AgentCredentials) error {
		if len(c.TLS.VerifiedChains) > 0 {
			return nil // the good agent's certificate
		}
		rc.mu.Lock()
		rc.perID[c.AgentID]++
		rc.maxPerID = max(rc.maxPerID, rc.perID[c.AgentID])
		rc.total++
		rc.mu.Unlock()
		n := rc.now.Add(1)
		for {
			m := rc.peak.Load()
			if n <= m || rc.peak.CompareAndSwap(m, n) {
				break
			}
		}
		defer func() {
			rc.now.Add(-1)
			rc.mu.Lock()
			rc.perID[c.AgentID]--
			rc.mu.Unlock()
		}()
		return next(ctx, c)
	}
}

// tokenAuth maps the reviewer's outcome to a status, as server_cmd.go does.
func tokenAuth(r *auth.TokenReviewer) func(context.Context, AgentCredentials) error {
	return func(ctx context.Context, c AgentCredentials) error {
		if _, err := r.Review(ctx, c.Token); err != nil {
			return &wire.StatusError{Code: auth.StatusOf(err), Msg: err.Error()}
		}
		return nil
	}
}

// 5000 login HEADERS, each followed at once by RST_STREAM, with random bad
// tokens, over 16 connections: each connection gets one review (the
// others are refused while it runs, and the refused login ends the
// connection), reviews in flight never exceed the server's bound, the
// reset cancels the apiserver call, and the goroutines go back to the
// baseline. A good agent joins and serves dials meanwhile.
func TestHostileLoginRapidReset(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const (
		conns      = 16
		pairs      = 5000
		maxReviews = 4
	)
	fake := newFakeReviews(t, 200*time.Millisecond)
	var counter reviewCounter
	e := newEnv(t, func(c *Config) {
		c.AgentTLS.ClientAuth = tls.VerifyClientCertIfGiven
		c.MaxReviews = maxReviews
		c.AuthenticateAgent = counter.wrap(tokenAuth(fake.reviewer(t)))
	})
	echo := tunneltest.EchoServer(t)
	runtime.GC()
	base := runtime.NumGoroutine()

	var wg sync.WaitGroup
	var sent atomic.Int64
	var peers []*h2Peer
	for i := range conns {
		p := dialH2Peer(t, e, true)
		peers = append(peers, p)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := range pairs / conns {
				id := uint32(2*n + 1)
				if p.login(id, fmt.Sprintf("evil%d", i), fmt.Sprintf("bad-%d-%d-%x", i, n, time.Now().UnixNano()), false) != nil {
					return
				}
				if p.fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
					return
				}
				sent.Add(1)
			}
		}()
	}
	good := e.startAgent("good", "", nil)
	e.WaitAgents(1)
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("dial during the attack: %v", err)
	}
	wg.Wait()
	for _, p := range peers {
		if !p.waitClosed(5 * time.Second) {
			t.Fatal("a connection whose login was refused is still open")
		}
	}
	peak := runtime.NumGoroutine()
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("dial after the attack: %v", err)
	}
	// The baseline had no agent: stop the good one to compare.
	good.Stop()
	e.WaitAgents(0)
	tunneltest.WaitUntil(t, func() bool { return runtime.NumGoroutine() <= base+4 }, "goroutines back to the baseline")
	settled := runtime.NumGoroutine()

	counter.mu.Lock()
	total, maxPerID := counter.total, counter.maxPerID
	counter.mu.Unlock()
	if maxPerID > 1 {
		t.Errorf("%d reviews at once for one connection, want at most 1", maxPerID)
	}
	if total > conns {
		t.Errorf("%d reviews for %d connections, want at most one each", total, conns)
	}
	if p := counter.peak.Load(); p > maxReviews {
		t.Errorf("%d reviews in flight at once, bound %d", p, maxReviews)
	}
	t.Logf("%d HEADERS+RST pairs sent on %d connections: %d reviews (at most %d per connection, %d at once; bound %d), %d apiserver calls (%d at once, %d cancelled); goroutines %d before, %d once the attackers were gone, %d after",
		sent.Load(), conns, total, maxPerID, counter.peak.Load(), maxReviews, fake.calls.Load(), fake.maxInFlight.Load(), fake.cancelled.Load(), base, peak, settled)
}

// Logins sent without a reset, several streams per connection: the first
// stream's review runs alone, the others are refused at once (no review),
// and the server-wide bound holds across connections.
func TestHostileLoginOnePerConnection(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const (
		conns      = 12
		streams    = 50
		maxReviews = 3
	)
	fake := newFakeReviews(t, 300*time.Millisecond)
	var counter reviewCounter
	e := newEnv(t, func(c *Config) {
		c.AgentTLS.ClientAuth = tls.VerifyClientCertIfGiven
		c.MaxReviews = maxReviews
		c.AuthenticateAgent = counter.wrap(tokenAuth(fake.reviewer(t)))
	})
	echo := tunneltest.EchoServer(t)
	var wg sync.WaitGroup
	var peers []*h2Peer
	for i := range conns {
		p := dialH2Peer(t, e, true)
		peers = append(peers, p)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := range streams {
				if p.login(uint32(2*n+1), fmt.Sprintf("evil%d", i), fmt.Sprintf("bad-%d-%d", i, n), true) != nil {
					return
				}
			}
		}()
	}
	e.startAgent("good", "", nil)
	e.WaitAgents(1)
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("dial during the attack: %v", err)
	}
	wg.Wait()
	for _, p := range peers {
		if !p.waitClosed(10 * time.Second) {
			t.Fatal("a connection whose login was refused is still open")
		}
	}
	counter.mu.Lock()
	total, maxPerID := counter.total, counter.maxPerID
	counter.mu.Unlock()
	if maxPerID > 1 || total > conns {
		t.Errorf("%d reviews (at most %d at once for one connection) for %d connections: want one each", total, maxPerID, conns)
	}
	if p := counter.peak.Load(); p > maxReviews {
		t.Errorf("%d reviews in flight at once, bound %d", p, maxReviews)
	}
	if n := fake.maxInFlight.Load(); n > maxReviews {
		t.Errorf("%d apiserver calls at once, bound %d", n, maxReviews)
	}
	t.Logf("%d connections x %d login streams: %d reviews, %d apiserver calls, at most %d at once (bound %d)",
		conns, streams, total, fake.calls.Load(), counter.peak.Load(), maxReviews)
}

// Connections that pass TLS with ALPN h2 and then never log in (no
// preface; a preface and SETTINGS only; a login whose review never ends)
// are closed at the header timeout, and a review left running is
// cancelled. Admitted agents (ours and an upstream one) keep their
// connections past it.
func TestHostileIdleH2Closed(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const headerTimeout = time.Second
	reviewEnded := make(chan error, 1)
	e := newEnv(t, func(c *Config) {
		c.AgentTLS.ClientAuth = tls.VerifyClientCertIfGiven
		c.HeaderTimeout = headerTimeout
		c.AuthenticateAgent = func(ctx context.Context, cr AgentCredentials) error {
			if len(cr.TLS.VerifiedChains) > 0 {
				return nil
			}
			<-ctx.Done() // an apiserver that never answers
			reviewEnded <- ctx.Err()
			return &wire.StatusError{Code: http.StatusServiceUnavailable, Msg: "review: " + ctx.Err().Error()}
		}
	})
	echo := tunneltest.EchoServer(t)
	silent := dialH2Peer(t, e, false)
	prefaced := dialH2Peer(t, e, true)
	hanging := dialH2Peer(t, e, true)
	if err := hanging.login(1, "evil", "never-reviewed", false); err != nil {
		t.Fatal(err)
	}
	e.startAgent("good", "", nil)
	up := startFakeUpstreamAgent(t, e, "upstream", "")
	e.WaitAgents(2)
	for name, p := range map[string]*h2Peer{"no preface": silent, "preface only": prefaced, "login never reviewed": hanging} {
		if !p.waitClosed(headerTimeout + 5*time.Second) {
			t.Fatalf("%s: connection still open %s after the header timeout", name, 5*time.Second)
		}
		t.Logf("%s: closed after %s (header timeout %s)", name, p.cutAt.Round(time.Millisecond), headerTimeout)
	}
	select {
	case err := <-reviewEnded:
		t.Logf("the hanging review ended: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("the review of a closed connection was not cancelled")
	}
	// Past the header timeout, both admitted agents are still connected
	// and serve.
	if n := e.srv.AgentCount(); n != 2 {
		t.Fatalf("%d agents after the header timeout, want 2", n)
	}
	before := up.dialCount()
	for range 4 {
		if err := e.EchoOnce(echo); err != nil {
			t.Fatalf("dial after the header timeout: %v", err)
		}
	}
	t.Logf("admitted agents still serve past the header timeout (upstream agent took %d of 4 dials)", up.dialCount()-before)
}

// More connections than MaxUnadmitted waiting at once, and none of them
// moving: once no slot has freed for the stall bound, the ones past the
// limit are closed before their TLS handshake and counted; a good agent
// gets in once slots free.
func TestHostileUnadmittedLimit(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const limit = 8
	e := newEnv(t, func(c *Config) {
		c.MaxUnadmitted = limit
		c.HeaderTimeout = 20 * time.Second // slots are freed by the attackers leaving, not by the timeout
	})
	echo := tunneltest.EchoServer(t)
	var holders []net.Conn
	for range limit {
		c, err := net.Dial("tcp", e.AgentAddr)
		if err != nil {
			t.Fatal(err)
		}
		holders = append(holders, c)
	}
	tunneltest.WaitUntil(t, func() bool { return e.srv.gate.open.Load() == limit }, "the server to count the waiting connections")

	// Past the limit, with the slots stalled: closed, after one plain-text
	// 503 saying when to come back.
	const extra = 20
	var cut []time.Duration
	for range extra {
		start := time.Now()
		c, err := net.Dial("tcp", e.AgentAddr)
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
		c.Close()
		if tunneltest.IsTimeout(err) {
			t.Fatal("a connection past the limit was kept")
		}
		cut = append(cut, time.Since(start))
	}
	var metrics strings.Builder
	e.srv.cfg.Metrics.WriteText(&metrics)
	if want := fmt.Sprintf(`%sunadmitted_agent_connections_closed_total{reason="limit"} %d`, serverPrefix, extra); !strings.Contains(metrics.String(), want) {
		t.Errorf("metrics lack %q:\n%s", want, metrics.String())
	}

	// A good agent cannot get in while the slots are held, and does once
	// they free.
	a := e.startAgent("good", "", nil)
	tunneltest.WaitUntil(t, func() bool {
		var m strings.Builder
		e.srv.cfg.Metrics.WriteText(&m)
		return !strings.Contains(m.String(), fmt.Sprintf(`reason="limit"} %d`, extra))
	}, "the agent to be turned away")
	if n := e.srv.AgentCount(); n != 0 {
		t.Fatalf("%d agents admitted past the limit", n)
	}
	for _, c := range holders {
		c.Close()
	}
	e.WaitAgents(1)
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("dial once slots freed: %v", err)
	}
	_ = a
	tunneltest.WaitUntil(t, func() bool { return e.srv.gate.open.Load() == 0 }, "no connection left waiting")
	slowest := time.Duration(0)
	for _, d := range cut {
		slowest = max(slowest, d)
	}
	t.Logf("%d connections past the limit of %d closed, the slowest after %s; good agent joined once slots freed", extra, limit, slowest.Round(time.Microsecond))
}

// A review that cannot be done (the apiserver is down) answers both kinds
// of agent "authentication unavailable" and nothing more; the cause, with
// the apiserver's address, is in the log, once per line and without the
// token.
func TestHostileReviewUnavailable(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const secret = "tok-unavailable-5b1e"
	fake := newFakeReviews(t, 0)
	reviewer := fake.reviewer(t)
	apiserver := strings.TrimPrefix(fake.srv.URL, "http://")
	fake.srv.Close() // down
	var logBuf lockedBuf
	e := newEnv(t, func(c *Config) {
		c.AgentTLS.ClientAuth = tls.NoClientCert
		c.AuthenticateAgent = tokenAuth(reviewer)
		c.Logger = slog.New(slog.NewTextHandler(&logBuf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})

	// Our agents' handshake.
	c, err := tls.Dial("tcp", e.AgentAddr, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	wire.WriteHello(c, "127.0.0.1", wire.AgentHello{ID: "a1", Token: secret})
	_, err = wire.ReadReply(bufio.NewReader(c))
	c.Close()
	var se *wire.StatusError
	if !errors.As(err, &se) || se.Code != http.StatusServiceUnavailable || se.Msg != "authentication unavailable" {
		t.Fatalf("handshake answer: %v, want 503 authentication unavailable", err)
	}

	// Upstream agents' gRPC login.
	raw, err := tls.Dial("tcp", e.AgentAddr, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1", NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	//lint:ignore SA1019 an HTTP/2 client on a TLS connection it dialled, as grpc-go's would be
	cc, err := (&http2.Transport{}).NewClientConn(raw)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	req, _ := http.NewRequest(http.MethodPost, "https://server"+agentConnectMethod, http.NoBody)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("agentid", "a2")
	req.Header.Set("Authorization", "Bearer "+secret)
	resp, err := cc.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if st, msg := resp.Header.Get("Grpc-Status"), resp.Header.Get("Grpc-Message"); st != fmt.Sprint(grpcUnavailable) || msg != "authentication unavailable" {
		t.Fatalf("gRPC login answer: status %q message %q, want %d authentication unavailable", st, msg, grpcUnavailable)
	}

	e.Stop()
	logs := logBuf.String()
	if strings.Contains(logs, secret) {
		t.Fatalf("token in the log:\n%s", logs)
	}
	var lines []string
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(l, "agent authentication unavailable") {
			lines = append(lines, l)
		}
	}
	// Both refusals come from one address: the second line may be held
	// back by the rate limit, never the first.
	if len(lines) == 0 || !strings.Contains(lines[0], apiserver) {
		t.Fatalf("no warning naming the apiserver %s:\n%s", apiserver, logs)
	}
	t.Logf("peer saw 503/UNAVAILABLE \"authentication unavailable\"; log: %s", lines[0])
}

// A peer that sends its handshake and hangs up while its login is
// reviewed cancels the review at once, not at the header timeout; a
// good agent's handshake is not disturbed by the watch.
func TestHostileHandshakeHangupCancelsReview(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	reviewEnded := make(chan error, 1)
	e := newEnv(t, func(c *Config) {
		c.AgentTLS.ClientAuth = tls.VerifyClientCertIfGiven
		c.HeaderTimeout = time.Minute
		c.AuthenticateAgent = func(ctx context.Context, cr AgentCredentials) error {
			if len(cr.TLS.VerifiedChains) > 0 {
				return nil
			}
			<-ctx.Done() // an apiserver that never answers
			reviewEnded <- ctx.Err()
			return &wire.StatusError{Code: http.StatusServiceUnavailable, Msg: "review: " + ctx.Err().Error()}
		}
	})
	echo := tunneltest.EchoServer(t)
	c, err := tls.Dial("tcp", e.AgentAddr, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	if err := wire.WriteHello(c, "127.0.0.1", wire.AgentHello{ID: "leaver", Token: "some-token"}); err != nil {
		t.Fatal(err)
	}
	tunneltest.WaitUntil(t, func() bool { return e.srv.gate.inflight.Load() == 1 }, "the review to start")
	start := time.Now()
	c.Close()
	select {
	case err := <-reviewEnded:
		t.Logf("review ended %s after the peer hung up (header timeout 1m): %v", time.Since(start).Round(time.Millisecond), err)
	case <-time.After(10 * time.Second):
		t.Fatal("the review outlived the connection that asked for it")
	}
	tunneltest.WaitUntil(t, func() bool { return e.srv.gate.open.Load() == 0 }, "the connection to stop counting")
	e.startAgent("good", "", nil)
	e.WaitAgents(1)
	if err := e.EchoOnce(echo); err != nil {
		t.Fatal(err)
	}
}

// A peer the gRPC front door refuses (its Unix credentials) is answered
// PERMISSION_DENIED and its connection is closed at the header timeout,
// however it behaves; an accepted client is not.
func TestHostileRefusedFrontendPeerClosed(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const headerTimeout = time.Second
	var refuse atomic.Bool
	refuse.Store(true)
	e := newEnv(t, func(c *Config) {
		c.HeaderTimeout = headerTimeout
		c.CheckFrontendPeer = func(net.Conn) error {
			if refuse.Load() {
				return &wire.StatusError{Code: http.StatusForbidden, Msg: "uid 4242 is not allowed"}
			}
			return nil
		}
	})
	sock := e.grpcSocket(t)
	call := tunneltest.OpenGRPC(t, sock, grpcwire.ProxyMethod)
	if st := call.Status(); st != fmt.Sprint(grpcPermissionDenied) {
		t.Fatalf("refused peer's call: status %q, want %d", st, grpcPermissionDenied)
	}
	// The same peer, raw: preface and SETTINGS, then silence.
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	io.WriteString(c, http2.ClientPreface)
	http2.NewFramer(c, nil).WriteSettings()
	c.SetReadDeadline(time.Now().Add(headerTimeout + 10*time.Second))
	_, err = io.Copy(io.Discard, c)
	if tunneltest.IsTimeout(err) {
		t.Fatal("a refused front-door peer kept its connection past the header timeout")
	}
	t.Logf("refused front-door peer closed after %s (header timeout %s)", time.Since(start).Round(time.Millisecond), headerTimeout)

	// An accepted client keeps an idle connection past the header timeout.
	refuse.Store(false)
	ok, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ok.Close()
	io.WriteString(ok, http2.ClientPreface)
	http2.NewFramer(ok, nil).WriteSettings()
	ok.SetReadDeadline(time.Now().Add(2 * headerTimeout))
	_, err = io.Copy(io.Discard, ok)
	if !tunneltest.IsTimeout(err) {
		t.Fatalf("an accepted front-door client was cut: %v", err)
	}
}

// Before its login is admitted, an h2 peer on the agent port gets small
// receive windows: what it can make the server hold is bounded.
func TestHostilePreAdmitWindows(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) { c.AgentTLS.ClientAuth = tls.VerifyClientCertIfGiven })
	c, err := tls.Dial("tcp", e.AgentAddr, &tls.Config{RootCAs: e.PKI.Pool, ServerName: "127.0.0.1", NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, http2.ClientPreface)
	fr := http2.NewFramer(c, c)
	fr.WriteSettings()
	streamWin, connWin := uint32(65535), uint32(65535)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("read the server's SETTINGS: %v", err)
		}
		if sf, ok := f.(*http2.SettingsFrame); ok && !sf.IsAck() {
			if v, ok := sf.Value(http2.SettingInitialWindowSize); ok {
				streamWin = v
			}
			continue
		}
		if wu, ok := f.(*http2.WindowUpdateFrame); ok && wu.StreamID == 0 {
			connWin += wu.Increment
			continue
		}
		if sf, ok := f.(*http2.SettingsFrame); ok && sf.IsAck() {
			break
		}
	}
	if streamWin > preAdmitStreamWindow || connWin > preAdmitConnWindow {
		t.Fatalf("before login: stream window %d, connection window %d; want at most %d and %d", streamWin, connWin, preAdmitStreamWindow, preAdmitConnWindow)
	}
	t.Logf("before login: stream window %d, connection window %d", streamWin, connWin)
}

// The deadline and admission race for every connection: each ends exactly
// one way (admitted, or closed and counted as timed out), and the count of
// waiting connections goes back to zero.
func TestAdmissionDeadlineRace(t *testing.T) {
	a := newAdmission(promtext.NewRegistry(), 1000, 1)
	var admitted, closed atomic.Int64
	var wg sync.WaitGroup
	for i := range 1000 {
		c1, c2 := net.Pipe()
		p := a.enter(c1, time.Duration(i%50)*time.Microsecond)
		if p == nil {
			t.Fatal("refused under the limit")
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c2.Close()
			if p.admit() {
				admitted.Add(1)
				c1.Close()
				return
			}
			// The deadline won: the connection is closed.
			if _, err := c2.Read(make([]byte, 1)); err == nil {
				t.Error("a connection that was not admitted is still open")
			}
			closed.Add(1)
		}()
	}
	wg.Wait()
	if n := a.open.Load(); n != 0 {
		t.Fatalf("%d connections still counted as waiting", n)
	}
	t.Logf("1000 races: %d admitted, %d closed at the deadline", admitted.Load(), closed.Load())
	if admitted.Load()+closed.Load() != 1000 || int64(a.timedOut.Value()) != closed.Load() {
		t.Fatalf("%d admitted + %d closed (%d counted as timed out), want 1000", admitted.Load(), closed.Load(), a.timedOut.Value())
	}
}
