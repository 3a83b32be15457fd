package e2e

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Attacks on the agent port before login, against the release binary,
// measured from outside the process (RSS from /proc, goroutines from
// pprof, TokenReviews at a fake apiserver): a PING flood that never reads,
// HEADERS+RST_STREAM pairs with bad tokens, h2 connections that never log
// in, and more unadmitted connections than the server lets wait. During
// each a good agent joins and serves requests. The figures go to
// RELIABILITY.md.

// reviewMeter is a TokenReview endpoint that holds each review for hold
// (an apiserver under load), accepts only goodToken, and counts reviews
// and how many were in flight at once.
type reviewMeter struct {
	srv                         *httptest.Server
	hold                        time.Duration
	calls, now, peak, cancelled atomic.Int64
}

func startReviewMeter(t *testing.T, p *pki, hold time.Duration) *reviewMeter {
	m := &reviewMeter{hold: hold}
	m.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Spec struct {
				Token string `json:"token"`
			} `json:"spec"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil {
			http.Error(w, "bad TokenReview", http.StatusBadRequest)
			return
		}
		m.calls.Add(1)
		n := m.now.Add(1)
		defer m.now.Add(-1)
		for p := m.peak.Load(); n > p && !m.peak.CompareAndSwap(p, n); p = m.peak.Load() {
		}
		good := req.Spec.Token == goodToken
		if !good {
			select {
			case <-time.After(m.hold):
			case <-r.Context().Done():
				m.cancelled.Add(1)
				return
			}
		}
		status := map[string]any{"authenticated": false}
		if good {
			status = map[string]any{"authenticated": true, "user": map[string]any{"username": agentSAUser}, "audiences": []string{agentAudience}}
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(map[string]any{"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status})
	}))
	m.srv.TLS = newServerTLSRequiringClient(t, p)
	m.srv.StartTLS()
	t.Cleanup(m.srv.Close)
	return m
}

// attackServer is a server with token auth against m (and client
// certificates, for the good agent), profiling on for goroutine counts.
func attackServer(t *testing.T, p *pki, m *reviewMeter, extra ...string) *server {
	dir := t.TempDir()
	kc := filepath.Join(dir, "kubeconfig")
	(&fakeAPIServer{srv: m.srv}).writeKubeconfig(t, p, kc)
	return startServerOpts(t, serverOpts{pki: p, clusterCA: p.caCert, extra: append(append(tokenAuthFlags(kc), "--enable-profiling"), extra...)})
}

// h2Attacker is a raw TLS connection with ALPN h2 to the agent port.
type h2Attacker struct {
	conn   *tls.Conn
	fr     *http2.Framer
	hbuf   bytes.Buffer
	enc    *hpack.Encoder
	start  time.Time
	closed chan struct{} // a read failed: the server closed the connection
	cutAt  time.Duration // valid after closed
}

// dialAttacker connects and, with preface, sends the client preface and
// SETTINGS. With read it drains what the server sends, to see it close;
// without, it never reads (the server's writes pile up).
func dialAttacker(t *testing.T, s *server, p *pki, preface, read bool) *h2Attacker {
	t.Helper()
	a, err := dialAttackerErr(t, s, p, preface, read)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// dialAttackerErr is dialAttacker for goroutines other than the test's.
func dialAttackerErr(t *testing.T, s *server, p *pki, preface, read bool) (*h2Attacker, error) {
	caPEM, err := os.ReadFile(p.caCert)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	a := &h2Attacker{start: time.Now(), closed: make(chan struct{})}
	a.conn, err = tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", "127.0.0.1:"+strconv.Itoa(s.agentPort),
		&tls.Config{RootCAs: pool, ServerName: "127.0.0.1", NextProtos: []string{"h2"}})
	if err != nil {
		return nil, err
	}
	a.fr = http2.NewFramer(a.conn, a.conn)
	a.enc = hpack.NewEncoder(&a.hbuf)
	if preface {
		io.WriteString(a.conn, http2.ClientPreface)
		a.fr.WriteSettings()
	}
	if read {
		go func() {
			defer close(a.closed)
			io.Copy(io.Discard, a.conn)
			a.cutAt = time.Since(a.start)
		}()
	}
	t.Cleanup(func() { a.conn.Close() })
	return a, nil
}

func (a *h2Attacker) login(id uint32, token string) error {
	a.hbuf.Reset()
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "https"}, {":authority", "127.0.0.1"}, {":path", "/AgentService/Connect"},
		{"content-type", "application/grpc"}, {"agentid", "evil"}, {"authorization", "Bearer " + token},
	} {
		a.enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	return a.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: a.hbuf.Bytes(), EndHeaders: true})
}

// goodAgentDuring starts an agent with a client certificate, waits until
// the server has it, serves n requests through it, and stops it; it
// returns how long joining and serving took.
func goodAgentDuring(t *testing.T, s *server, p *pki, backend string, n int) time.Duration {
	t.Helper()
	start := time.Now()
	a := startAgentArgs(t, "good", append(mtlsAgentArgs(p, "127.0.0.1", s.agentPort), "--sync-interval=100ms", "--sync-interval-cap=500ms")...)
	s.waitAgents(t, 1, 20*time.Second)
	checkReachable(t, s.egressDialer(t), backend, "b1", n)
	took := time.Since(start)
	a.proc.stop(t)
	s.waitAgents(t, 0, 10*time.Second)
	return took
}

// TestAgentPortPingFlood: a peer that opens h2 connections to the agent
// port, never logs in and never reads, and sends PING frames for 10 s,
// reconnecting when dropped. The server's RSS must stay within a few MiB
// (its answers are capped and the connection is dropped), and a good agent
// still gets in meanwhile.
func TestAgentPortPingFlood(t *testing.T) {
	p := newPKI(t, t.TempDir())
	m := startReviewMeter(t, p, 0)
	s := attackServer(t, p, m) // default header timeout: 10 s
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	pid := s.proc.cmd.Process.Pid
	// The baseline once start-up is over: RSS unchanged (within 256 KiB)
	// over 200 ms, or after 3 s.
	rss0 := faultRSSKiB(t, pid)
	for settle := time.Now().Add(3 * time.Second); time.Now().Before(settle); {
		time.Sleep(200 * time.Millisecond)
		now := faultRSSKiB(t, pid)
		if now-rss0 < 256 && rss0-now < 256 {
			break
		}
		rss0 = now
	}

	// Flood for 10 s, 1,000 PINGs per write, as fast as the socket takes
	// them; when the server drops the connection, open another.
	const flood = 10 * time.Second
	var sent, conns atomic.Int64
	var writeErr atomic.Value
	var batch bytes.Buffer
	bfr := http2.NewFramer(&batch, nil)
	for range 1000 {
		bfr.WritePing(false, [8]byte{})
	}
	start := time.Now()
	done := make(chan struct{})
	var lives []time.Duration // how long each connection took the flood; read after done
	go func() {
		defer close(done)
		for time.Since(start) < flood {
			a, err := dialAttackerErr(t, s, p, true, false)
			if err != nil {
				continue
			}
			conns.Add(1)
			a.conn.SetWriteDeadline(start.Add(flood))
			for time.Since(start) < flood {
				if _, err := a.conn.Write(batch.Bytes()); err != nil {
					writeErr.Store(err.Error())
					break
				}
				sent.Add(1000)
			}
			lives = append(lives, time.Since(a.start))
			a.conn.Close()
		}
	}()
	var peakKiB atomic.Int64
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			if kib, err := rssKiB(pid); err == nil && kib > peakKiB.Load() {
				peakKiB.Store(kib)
			}
			select {
			case <-done:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	took := goodAgentDuring(t, s, p, backend, 5)
	<-done
	<-sampled
	floodFor := time.Since(start)
	peak := max(int(peakKiB.Load()), faultRSSKiB(t, pid))
	why, _ := writeErr.Load().(string)
	if why == "" {
		why = "none: the connection stayed open"
	}
	slices.Sort(lives)
	var shortest, median, longest time.Duration
	if n := len(lives); n > 0 {
		shortest, median, longest = lives[0], lives[n/2], lives[n-1]
	}
	t.Logf("PING flood, never reading: %d PINGs over %d connections in %s (a connection took the flood for %s shortest, %s median, %s longest); server RSS %d KiB before, peak %d KiB (+%.1f MiB); last write error: %s; good agent joined and served 5 requests in %s",
		sent.Load(), conns.Load(), floodFor.Round(time.Millisecond), shortest.Round(time.Millisecond), median.Round(time.Millisecond), longest.Round(time.Millisecond),
		rss0, peak, float64(peak-rss0)/1024, why, took.Round(time.Millisecond))
	if peak-rss0 > 64<<10 {
		t.Errorf("server RSS grew by %d MiB under the flood", (peak-rss0)>>10)
	}
}

// TestAgentPortRapidResetLogins: 5,000 HEADERS(/AgentService/Connect, a
// random bad token)+RST_STREAM pairs, reconnecting whenever the server
// closes the connection. TokenReviews: at most one per connection at a
// time; goroutines back to the baseline within seconds.
func TestAgentPortRapidResetLogins(t *testing.T) {
	p := newPKI(t, t.TempDir())
	m := startReviewMeter(t, p, 100*time.Millisecond)
	s := attackServer(t, p, m)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	base := takeFaultBaseline(t, "server", s.proc.cmd.Process.Pid, s.adminPort)

	const pairs = 5000
	var sent, conns atomic.Int64
	var peakG atomic.Int64
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		for sent.Load() < pairs && time.Since(start) < 20*time.Second {
			a, err := dialAttackerErr(t, s, p, true, true)
			if err != nil {
				continue // refused at the limit, or the server is busy: try again
			}
			conns.Add(1)
			for id := uint32(1); sent.Load() < pairs; id += 2 {
				if a.login(id, fmt.Sprintf("bad-%d-%x", id, time.Now().UnixNano())) != nil || a.fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
					break
				}
				sent.Add(1)
			}
			a.conn.Close()
		}
	}()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			case <-time.After(100 * time.Millisecond):
			}
			if g, err := goroutines(s.adminPort); err == nil {
				n := int64(g.total)
				for p := peakG.Load(); n > p && !peakG.CompareAndSwap(p, n); p = peakG.Load() {
				}
			}
		}
	}()
	took := goodAgentDuring(t, s, p, backend, 5)
	<-done
	wg.Wait()
	attack := time.Since(start)
	ended := time.Now()
	var rest time.Duration = -1
	var last goroutineCount
	for time.Since(ended) < 30*time.Second {
		if g, err := goroutines(s.adminPort); err == nil {
			last = g
			if g.ours() <= base.goroutines+2 && g.conns <= maxPooledConns {
				rest = time.Since(ended)
				break
			}
		}
		time.Sleep(pollInterval)
	}
	restText := "not within 30 s"
	if rest >= 0 {
		restText = rest.Round(time.Millisecond).String()
	}
	t.Logf("%d HEADERS+RST pairs over %d connections in %s: %d TokenReviews at the apiserver (%d at once, %d cancelled by the peer's reset); server goroutines %d at rest, peak %d (0: the profile did not answer), back at rest after the attack: %s (%s); good agent joined and served 5 requests in %s; unavailable=%v refused-at-limit=%v",
		sent.Load(), conns.Load(), attack.Round(time.Millisecond), m.calls.Load(), m.peak.Load(), m.cancelled.Load(), base.goroutines, peakG.Load(),
		restText, last, took.Round(time.Millisecond),
		metricValue(t, s.healthURL("/metrics"), "konnectivity_network_proxy_server_agent_authentication_unavailable_total"),
		metricValue(t, s.healthURL("/metrics"), "konnectivity_network_proxy_server_unadmitted_agent_connections_closed_total", "reason", "limit"))
	if rest < 0 {
		_, stacks, _ := fetch(fmt.Sprintf("http://127.0.0.1:%d/debug/pprof/goroutine?debug=1", s.adminPort))
		t.Errorf("server not back at rest (%d goroutines of ours, at most %d pooled connections to the apiserver) 30 s after the attack: %s; its goroutines:\n%s", base.goroutines, maxPooledConns, last, stacks)
	}
	if c := m.calls.Load(); c > conns.Load() {
		t.Errorf("%d TokenReviews for %d connections: more than one per connection", c, conns.Load())
	}
	if sent.Load() < pairs {
		t.Errorf("attack sent only %d pairs", sent.Load())
	}
}

// TestAgentPortIdleH2: connections that never log in (TLS only; preface
// and SETTINGS only; a login whose review never ends) are closed at the
// header timeout; past the limit of unadmitted connections, with its slots
// stalled (none freed for a quarter of the header timeout), new ones are
// closed before their TLS handshake; a good agent still gets in.
func TestAgentPortIdleH2(t *testing.T) {
	p := newPKI(t, t.TempDir())
	m := startReviewMeter(t, p, time.Hour) // a review of a bad token never ends
	const headerTimeout = 2 * time.Second
	s := attackServer(t, p, m, "--frontend-header-timeout="+headerTimeout.String(), "--max-unadmitted-agent-connections=16")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")

	silent := dialAttacker(t, s, p, false, true)
	prefaced := dialAttacker(t, s, p, true, true)
	hanging := dialAttacker(t, s, p, true, true)
	if err := hanging.login(1, "bad-never-answered"); err != nil {
		t.Fatal(err)
	}
	took := goodAgentDuring(t, s, p, backend, 5)
	for name, a := range map[string]*h2Attacker{"TLS only": silent, "preface and SETTINGS": prefaced, "login under review": hanging} {
		select {
		case <-a.closed:
			t.Logf("idle h2 connection (%s): closed by the server after %s (header timeout %s)", name, a.cutAt.Round(time.Millisecond), headerTimeout)
		case <-time.After(headerTimeout + 10*time.Second):
			t.Fatalf("idle h2 connection (%s) still open %s after the header timeout", name, 10*time.Second)
		}
	}
	waitFor(t, 5*time.Second, "the hanging review to be cancelled", func() bool { return m.cancelled.Load() == 1 })
	t.Logf("the review of the closed connection was cancelled at the apiserver; good agent joined and served 5 requests in %s", took.Round(time.Millisecond))

	// The limit: 16 connections that say nothing hold every slot.
	var holders []net.Conn
	for range 16 {
		c, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(s.agentPort))
		if err != nil {
			t.Fatal(err)
		}
		holders = append(holders, c)
	}
	waitFor(t, 5*time.Second, "16 unadmitted connections", func() bool {
		return metricValue(t, s.healthURL("/metrics"), "konnectivity_network_proxy_server_unadmitted_agent_connections") == 16
	})
	var slowest time.Duration
	for range 50 {
		start := time.Now()
		c, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(s.agentPort))
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(headerTimeout / 2))
		_, err = c.Read(make([]byte, 1))
		c.Close()
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatal("a connection past the limit was kept")
		}
		slowest = max(slowest, time.Since(start))
	}
	for _, c := range holders {
		c.Close()
	}
	took = goodAgentDuring(t, s, p, backend, 5)
	t.Logf("past --max-unadmitted-agent-connections=16, its slots stalled: 50 connections closed (slowest %s), counted %v; once the slots freed a good agent joined and served 5 requests in %s",
		slowest.Round(time.Microsecond), metricValue(t, s.healthURL("/metrics"), "konnectivity_network_proxy_server_unadmitted_agent_connections_closed_total", "reason", "limit"), took.Round(time.Millisecond))
}

// rssKiB is VmRSS of pid, for goroutines other than the test's.
func rssKiB(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			return strconv.ParseInt(f[1], 10, 64)
		}
	}
	return 0, fmt.Errorf("no VmRSS for %d", pid)
}

// TestAgentPortAdmittedKeepsConnection: the header timeout bounds only
// the time to admission. A grpc-go agent (as upstream's proxy-agent)
// that logged in with a token keeps its connection and serves long after
// it, and the server counts no connection closed for time.
func TestAgentPortAdmittedKeepsConnection(t *testing.T) {
	p := newPKI(t, t.TempDir())
	m := startReviewMeter(t, p, 0)
	const headerTimeout = time.Second
	s := attackServer(t, p, m, "--frontend-header-timeout="+headerTimeout.String())
	up, err := connectUpstreamAgent(t, s.agentPort, upstreamTLS(t, p, false), "token-agent", "", goodToken)
	if err != nil {
		t.Fatalf("good token: %v", err)
	}
	defer up.checkClean(t)
	s.waitAgents(t, 1, startTimeout)
	// Past the header timeout three times over (nothing to wait on: the
	// event checked is one that must not happen).
	time.Sleep(3 * headerTimeout)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	checkReachable(t, s.egressDialer(t), backend, "b1", 10)
	if got := up.dialsOK.Load(); got != 10 {
		t.Errorf("the admitted agent dialled %d, want 10", got)
	}
	if n := metricValue(t, s.healthURL("/metrics"), "konnectivity_network_proxy_server_unadmitted_agent_connections_closed_total", "reason", "timeout"); n != 0 {
		t.Errorf("%v connections closed for time, want 0", n)
	}
}

// TestAgentPortBacklogFlood: past --max-unadmitted-agent-connections the
// agent port accepts nothing, so a flood of raw connections waits in the
// kernel's listen backlog: the server holds no descriptor for them, counts
// no more than the limit as unadmitted and refuses none until the backlog
// is nearly full (all but a sixteenth); past that it refuses the oldest, and the backlog
// never overflows. Once the silent holders of every slot leave, the flood
// (bytes that are not TLS) is accepted in arrival order and dropped at its
// first record, and a good agent behind it joins.
func TestAgentPortBacklogFlood(t *testing.T) {
	p := newPKI(t, t.TempDir())
	m := startReviewMeter(t, p, time.Hour)
	// A long header timeout: no stall (a quarter of it) within the test.
	s := attackServer(t, p, m, "--frontend-header-timeout=1m", "--max-unadmitted-agent-connections=16")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	addr := "127.0.0.1:" + strconv.Itoa(s.agentPort)
	pid := s.proc.cmd.Process.Pid
	unadmitted := func() float64 {
		return metricValue(t, s.healthURL("/metrics"), "konnectivity_network_proxy_server_unadmitted_agent_connections")
	}
	limited := func() float64 {
		return metricValue(t, s.healthURL("/metrics"), "konnectivity_network_proxy_server_unadmitted_agent_connections_closed_total", "reason", "limit")
	}

	var holders []net.Conn
	for range 16 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		holders = append(holders, c)
	}
	waitFor(t, 5*time.Second, "16 unadmitted connections", func() bool { return unadmitted() == 16 })
	fds0, err := fdCount(pid)
	if err != nil {
		t.Fatal(err)
	}

	const flood = 1000
	junk := []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	var floods []net.Conn
	for range flood {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.Write(junk)
		floods = append(floods, c)
	}
	waitFor(t, 10*time.Second, "the flood in the listen backlog", func() bool { return listenBacklog(t, s.agentPort) == flood })
	fds1, err := fdCount(pid)
	if err != nil {
		t.Fatal(err)
	}
	if n := unadmitted(); n != 16 {
		t.Fatalf("%v connections counted as unadmitted with %d waiting in the backlog, want the limit 16", n, flood)
	}
	if fds1-fds0 > 16 {
		t.Fatalf("server descriptors %d → %d with %d connections waiting in the backlog", fds0, fds1, flood)
	}
	if n := limited(); n != 0 {
		t.Fatalf("%v connections refused below nearly full, want none", n)
	}

	// Up to all but a sixteenth of the backlog's limit they wait; past it the
	// oldest are accepted and refused, so the backlog never overflows (the
	// kernel would drop SYNs, and a dial would take a second or more).
	b, err := os.ReadFile("/proc/sys/net/core/somaxconn")
	if err != nil {
		t.Fatal(err)
	}
	somaxconn, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	const past = 200
	var slowest time.Duration
	for len(floods) < somaxconn-somaxconn/16+past {
		start := time.Now()
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		slowest = max(slowest, time.Since(start))
		c.Write(junk)
		floods = append(floods, c)
	}
	waitFor(t, 10*time.Second, "the oldest waiting connections refused", func() bool { return limited() >= past/2 })
	if slowest >= time.Second {
		t.Errorf("a dial took %s: its SYN was dropped, the backlog overflowed", slowest)
	}
	refused := limited()

	for _, c := range holders {
		c.Close()
	}
	took := goodAgentDuring(t, s, p, backend, 5)
	for _, c := range floods {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				t.Fatal("a flood connection was never accepted and closed")
			}
		}
	}
	t.Logf("%d raw connections past --max-unadmitted-agent-connections=16 waited in the backlog (server descriptors %d → %d, unadmitted 16, refused 0); %d more, past all but a sixteenth of the backlog's %d: %v of the oldest refused, slowest dial %s; once the holders left the rest were dropped in order and a good agent behind them joined and served 5 requests in %s",
		flood, fds0, fds1, len(floods)-flood, somaxconn, refused, slowest.Round(time.Microsecond), took.Round(time.Millisecond))
}

// listenBacklog is the number of connections waiting to be accepted on the
// TCP listener at port on this host (a listening socket's rx_queue in
// /proc/net/tcp).
func listenBacklog(t *testing.T, port int) int {
	t.Helper()
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf(":%04X", port)
	for _, line := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(line)
		// sl local_address rem_address st tx_queue:rx_queue ...; 0A is LISTEN.
		if len(f) < 5 || !strings.HasSuffix(f[1], want) || f[3] != "0A" {
			continue
		}
		_, rx, _ := strings.Cut(f[4], ":")
		n, err := strconv.ParseInt(rx, 16, 64)
		if err != nil {
			t.Fatalf("/proc/net/tcp: %q: %v", line, err)
		}
		return int(n)
	}
	t.Fatalf("no listener on port %d in /proc/net/tcp", port)
	return 0
}
