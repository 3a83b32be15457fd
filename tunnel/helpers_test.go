package tunnel

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/certs"
	"github.com/spinifex/konnectivity/internal/testnet"
)

// pki is a throwaway CA with a server and an agent certificate.
type pki struct {
	pool       *x509.CertPool
	serverCert tls.Certificate
	agentCert  tls.Certificate
	ca         *certs.CA
}

func newPKI(t testing.TB) *pki {
	t.Helper()
	ca, err := certs.NewCA("test CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	p := &pki{pool: x509.NewCertPool(), ca: ca}
	p.pool.AddCert(ca.Cert)
	p.serverCert = p.issue(t, certs.Request{CommonName: "server", IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, Validity: time.Hour})
	p.agentCert = p.issue(t, certs.Request{CommonName: "agent", Client: true, Validity: time.Hour})
	return p
}

func (p *pki) issue(t testing.TB, req certs.Request) tls.Certificate {
	t.Helper()
	certPEM, keyPEM, err := p.ca.Issue(req)
	if err != nil {
		t.Fatal(err)
	}
	c, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func testLogger(t testing.TB) *slog.Logger {
	if os.Getenv("TUNNEL_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// frontServer is what the harness needs of a server: its two listeners'
// loops, its end, and its count of connected agents.
type frontServer interface {
	ServeFrontend(net.Listener) error
	ServeAgents(net.Listener) error
	Close() error
	AgentCount() int
}

// ends is one server with its frontend socket and agent listener, all on
// loopback, torn down by t.Cleanup; agents reach it at agentAddr.
type ends struct {
	t         testing.TB
	pki       *pki
	srvEnds   frontServer
	uds       string
	agentAddr string
	wg        sync.WaitGroup
	once      sync.Once
	stopOnce  func()
}

// serveEnds serves srv's front door on a Unix socket and its agents on
// agentAddr until the test ends.
func serveEnds(t testing.TB, p *pki, agentAddr string, srv frontServer) *ends {
	t.Helper()
	dir, err := os.MkdirTemp("", "tun")
	if err != nil {
		t.Fatal(err)
	}
	e := &ends{t: t, pki: p, srvEnds: srv, uds: filepath.Join(dir, "s.sock")}
	udsLn, err := net.Listen("unix", e.uds)
	if err != nil {
		t.Fatal(err)
	}
	agentLn, err := net.Listen("tcp", agentAddr)
	if err != nil {
		t.Fatal(err)
	}
	e.agentAddr = agentLn.Addr().String()
	e.wg.Add(2)
	go func() { defer e.wg.Done(); srv.ServeFrontend(udsLn) }()
	go func() { defer e.wg.Done(); srv.ServeAgents(agentLn) }()
	e.stopOnce = func() {
		srv.Close()
		e.wg.Wait()
		os.RemoveAll(dir)
	}
	t.Cleanup(e.stop)
	return e
}

// stop closes the server at once, as a crash would look to its agents.
func (e *ends) stop() {
	e.once.Do(e.stopOnce)
}

// running is an in-process agent's run and the means to stop it.
type running struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// runAgent runs a until the test ends or stop is called.
func runAgent(t testing.TB, run func(context.Context) error) *running {
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{cancel: cancel, done: make(chan struct{})}
	go func() { defer close(r.done); run(ctx) }()
	t.Cleanup(r.stop)
	return r
}

func (r *running) stop() {
	r.cancel()
	<-r.done
}

// agentTLS is an agent's TLS configuration for the server name, with the
// agent certificate of p.
func (p *pki) agentTLS(name string) (*tls.Config, error) {
	return &tls.Config{RootCAs: p.pool, ServerName: name, Certificates: []tls.Certificate{p.agentCert}}, nil
}

// serverTLS is a server's agent listener TLS configuration, requiring an
// agent certificate of p.
func (p *pki) serverTLS() *tls.Config {
	return &tls.Config{Certificates: []tls.Certificate{p.serverCert}, ClientCAs: p.pool, ClientAuth: tls.RequireAndVerifyClientCert}
}

// waitAgents waits until the server has n agents.
func (e *ends) waitAgents(n int) {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for e.srvEnds.AgentCount() != n {
		if time.Now().After(deadline) {
			e.t.Fatalf("server has %d agents, want %d", e.srvEnds.AgentCount(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// connect sends a CONNECT the way kube-apiserver does and returns the
// connection, the reader positioned after the answer, and its status.
func (e *ends) connect(addr string) (net.Conn, *bufio.Reader, *http.Response) {
	e.t.Helper()
	conn, err := net.DialTimeout("unix", e.uds, 5*time.Second)
	if err != nil {
		e.t.Fatal(err)
	}
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", addr)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		conn.Close()
		e.t.Fatalf("read CONNECT answer: %v", err)
	}
	return conn, br, resp
}

// echoOne opens a tunnel to an echo destination and sends one byte there
// and back; it returns the open tunnel.
func (e *ends) echoOne(addr string) net.Conn {
	e.t.Helper()
	c, br, resp := e.connect(addr)
	if resp.StatusCode != 200 {
		c.Close()
		e.t.Fatalf("CONNECT: %s", resp.Status)
	}
	got := make([]byte, 1)
	if _, err := c.Write([]byte("x")); err != nil {
		c.Close()
		e.t.Fatal(err)
	}
	if _, err := io.ReadFull(br, got); err != nil {
		c.Close()
		e.t.Fatal(err)
	}
	return c
}

// echoServer echoes every connection until it is closed.
func echoServer(t testing.TB) string {
	t.Helper()
	return serveTCP(t, func(c net.Conn) { io.Copy(c, c); c.(*net.TCPConn).CloseWrite() })
}

// serveTCP runs handle for each connection on a loopback listener until
// the test ends.
func serveTCP(t testing.TB, handle func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := testnet.Serve(ln, handle)
	t.Cleanup(s.Close)
	return s.Addr()
}

func checkNoLeaks(t *testing.T) { testnet.CheckNoLeaks(t) }

func onlyOurs(stacks string) string { return testnet.OnlyOurs(stacks) }

func bufioReader(r io.Reader) *bufio.Reader { return bufio.NewReader(r) }

func certRequestFor(dns string, ips ...string) certs.Request {
	req := certs.Request{CommonName: "server", DNSNames: []string{dns}, Validity: time.Hour}
	for _, ip := range ips {
		req.IPAddresses = append(req.IPAddresses, net.ParseIP(ip))
	}
	return req
}

// testLB is a round-robin TCP load balancer on loopback. It can also
// blackhole: stop forwarding on every open connection without closing any,
// as a dead network path looks.
type testLB struct {
	ln net.Listener

	mu       sync.Mutex
	backends []string
	next     int
	conns    map[net.Conn]bool
	frozen   bool
	thaw     chan struct{}

	wg sync.WaitGroup
}

func newTestLB(t testing.TB, backends ...string) *testLB {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lb := &testLB{ln: ln, backends: backends, conns: map[net.Conn]bool{}, thaw: make(chan struct{})}
	lb.wg.Add(1)
	go lb.serve()
	t.Cleanup(lb.close)
	return lb
}

func (lb *testLB) addr() string { return lb.ln.Addr().String() }

func (lb *testLB) setBackends(b ...string) {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	lb.backends = b
}

func (lb *testLB) serve() {
	defer lb.wg.Done()
	for {
		c, err := lb.ln.Accept()
		if err != nil {
			return
		}
		lb.mu.Lock()
		backend := ""
		if len(lb.backends) > 0 {
			backend = lb.backends[lb.next%len(lb.backends)]
			lb.next++
		}
		lb.mu.Unlock()
		if backend == "" {
			c.Close()
			continue
		}
		up, err := net.Dial("tcp", backend)
		if err != nil {
			c.Close()
			continue
		}
		lb.track(c, up)
		lb.wg.Add(2)
		go lb.pipe(up, c)
		go lb.pipe(c, up)
	}
}

func (lb *testLB) track(cs ...net.Conn) {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	for _, c := range cs {
		lb.conns[c] = true
	}
}

// pipe copies src to dst, pausing (without closing anything) while frozen.
func (lb *testLB) pipe(dst, src net.Conn) {
	defer lb.wg.Done()
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		lb.mu.Lock()
		frozen, thaw := lb.frozen, lb.thaw
		lb.mu.Unlock()
		if frozen {
			<-thaw // drop nothing, forward nothing, until closed
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err == io.EOF {
				if cw, ok := dst.(interface{ CloseWrite() error }); ok {
					cw.CloseWrite()
				}
			}
			return
		}
	}
}

// blackhole stops forwarding on all connections, open and new.
func (lb *testLB) blackhole() {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	lb.frozen = true
}

func (lb *testLB) close() {
	lb.ln.Close()
	lb.mu.Lock()
	if lb.frozen {
		close(lb.thaw)
		lb.frozen = false
	}
	for c := range lb.conns {
		c.Close()
	}
	lb.mu.Unlock()
	lb.wg.Wait()
}

// waitUntil polls cond until it holds, failing the test after 10s.
func waitUntil(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not true within 10s: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitStalled waits until every counter has moved and then stood still for
// several polls in a row: the writers behind them are blocked.
func waitStalled(t *testing.T, what string, counters ...*atomic.Int64) {
	t.Helper()
	const still = 5 // polls 20ms apart
	snap := func() []int64 {
		v := make([]int64, len(counters))
		for i, c := range counters {
			v[i] = c.Load()
		}
		return v
	}
	deadline := time.Now().Add(10 * time.Second)
	last, same := snap(), 0
	for same < still {
		if time.Now().After(deadline) {
			t.Fatalf("not stalled within 10s: %s (counters %v)", what, last)
		}
		time.Sleep(20 * time.Millisecond)
		cur := snap()
		if slices.Equal(cur, last) && !slices.Contains(cur, 0) {
			same++
		} else {
			same = 0
		}
		last = cur
	}
}

// isTimeout reports whether err is a deadline expiry.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// heapInuse returns HeapInuse after a full collection.
func heapInuse() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// echoOnce checks that a fresh tunnel to echo carries a round trip.
func (e *ends) echoOnce(echo string) error {
	conn, err := net.DialTimeout("unix", e.uds, 5*time.Second)
	if err != nil {
		return err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", echo)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return fmt.Errorf("CONNECT answer: %w", err)
	}
	if resp.StatusCode != 200 {
		return fmt.Errorf("CONNECT status %d", resp.StatusCode)
	}
	io.WriteString(conn, "ping")
	got := make([]byte, 4)
	if _, err := io.ReadFull(br, got); err != nil || string(got) != "ping" {
		return fmt.Errorf("echo %q: %v", got, err)
	}
	return nil
}
