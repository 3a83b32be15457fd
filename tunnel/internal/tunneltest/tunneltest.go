// Package tunneltest is the harness of the tunnel's tests: a throwaway
// PKI, a server's front door socket and agent listener (ServeEnds), an
// in-process agent's run (RunAgent), a gRPC front door client, a load
// balancer that can blackhole, and waits. It starts both ends through the
// interfaces it declares (Server, and an agent's Run), not their packages,
// so the tests inside tunnel/server and tunnel/agent can both use it
// without an import cycle.
package tunneltest

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
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/certs"
	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/internal/testnet"
)

// PKI is a throwaway CA with a server and an agent certificate.
type PKI struct {
	Pool       *x509.CertPool
	ServerCert tls.Certificate
	AgentCert  tls.Certificate
	Ca         *certs.CA
}

func NewPKI(t testing.TB) *PKI {
	t.Helper()
	ca, err := certs.NewCA("test CA", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	p := &PKI{Pool: x509.NewCertPool(), Ca: ca}
	p.Pool.AddCert(ca.Cert)
	p.ServerCert = p.Issue(t, certs.Request{CommonName: "server", IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, Validity: time.Hour})
	p.AgentCert = p.Issue(t, certs.Request{CommonName: "agent", Client: true, Validity: time.Hour})
	return p
}

func (p *PKI) Issue(t testing.TB, req certs.Request) tls.Certificate {
	t.Helper()
	certPEM, keyPEM, err := p.Ca.Issue(req)
	if err != nil {
		t.Fatal(err)
	}
	c, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func Logger(t testing.TB) *slog.Logger {
	if os.Getenv("TUNNEL_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// Server is what the harness needs of a server: its two listeners'
// loops, its end, and its count of connected agents.
type Server interface {
	ServeFrontend(net.Listener) error
	ServeAgents(net.Listener) error
	Close() error
	AgentCount() int
}

// Ends is one server with its frontend socket and agent listener, all on
// loopback, torn down by t.Cleanup; agents reach it at agentAddr.
type Ends struct {
	T         testing.TB
	PKI       *PKI
	srvEnds   Server
	UDS       string
	AgentAddr string
	wg        sync.WaitGroup
	once      sync.Once
	stopOnce  func()
}

// ServeEnds serves srv's front door on a Unix socket and its agents on
// AgentAddr until the test ends.
func ServeEnds(t testing.TB, p *PKI, agentAddr string, srv Server) *Ends {
	t.Helper()
	dir, err := os.MkdirTemp("", "tun")
	if err != nil {
		t.Fatal(err)
	}
	e := &Ends{T: t, PKI: p, srvEnds: srv, UDS: filepath.Join(dir, "s.sock")}
	udsLn, err := net.Listen("unix", e.UDS)
	if err != nil {
		t.Fatal(err)
	}
	agentLn, err := net.Listen("tcp", agentAddr)
	if err != nil {
		t.Fatal(err)
	}
	e.AgentAddr = agentLn.Addr().String()
	e.wg.Add(2)
	go func() { defer e.wg.Done(); srv.ServeFrontend(udsLn) }()
	go func() { defer e.wg.Done(); srv.ServeAgents(agentLn) }()
	e.stopOnce = func() {
		srv.Close()
		e.wg.Wait()
		os.RemoveAll(dir)
	}
	t.Cleanup(e.Stop)
	return e
}

// ServeUnix runs serve on a Unix socket of its own until the server stops,
// and returns the socket's path.
func (e *Ends) ServeUnix(t testing.TB, serve func(net.Listener) error) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "sock")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "s.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	e.wg.Add(1)
	go func() { defer e.wg.Done(); serve(ln) }()
	t.Cleanup(func() { ln.Close(); os.RemoveAll(dir) })
	return path
}

// Stop closes the server at once, as a crash would look to its agents.
func (e *Ends) Stop() {
	e.once.Do(e.stopOnce)
}

// Running is an in-process agent's run and the means to stop it.
type Running struct {
	Cancel context.CancelFunc
	Done   chan struct{}
}

// RunAgent runs a until the test ends or stop is called.
func RunAgent(t testing.TB, run func(context.Context) error) *Running {
	ctx, cancel := context.WithCancel(context.Background())
	r := &Running{Cancel: cancel, Done: make(chan struct{})}
	go func() { defer close(r.Done); run(ctx) }()
	t.Cleanup(r.Stop)
	return r
}

func (r *Running) Stop() {
	r.Cancel()
	<-r.Done
}

// AgentTLS is an agent's TLS configuration for the server name, with the
// agent certificate of p.
func (p *PKI) AgentTLS(name string) (*tls.Config, error) {
	return &tls.Config{RootCAs: p.Pool, ServerName: name, Certificates: []tls.Certificate{p.AgentCert}}, nil
}

// ServerTLS is a server's agent listener TLS configuration, requiring an
// agent certificate of p.
func (p *PKI) ServerTLS() *tls.Config {
	return &tls.Config{Certificates: []tls.Certificate{p.ServerCert}, ClientCAs: p.Pool, ClientAuth: tls.RequireAndVerifyClientCert}
}

// WaitAgents waits until the server has n agents.
func (e *Ends) WaitAgents(n int) {
	e.T.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for e.srvEnds.AgentCount() != n {
		if time.Now().After(deadline) {
			e.T.Fatalf("server has %d agents, want %d", e.srvEnds.AgentCount(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Connect sends a CONNECT the way kube-apiserver does and returns the
// connection, the reader positioned after the answer, and its status.
func (e *Ends) Connect(addr string) (net.Conn, *bufio.Reader, *http.Response) {
	e.T.Helper()
	conn, err := net.DialTimeout("unix", e.UDS, 5*time.Second)
	if err != nil {
		e.T.Fatal(err)
	}
	conn.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", addr)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		conn.Close()
		e.T.Fatalf("read CONNECT answer: %v", err)
	}
	return conn, br, resp
}

// EchoOne opens a tunnel to an echo destination and sends one byte there
// and back; it returns the open tunnel.
func (e *Ends) EchoOne(addr string) net.Conn {
	e.T.Helper()
	c, br, resp := e.Connect(addr)
	if resp.StatusCode != 200 {
		c.Close()
		e.T.Fatalf("CONNECT: %s", resp.Status)
	}
	got := make([]byte, 1)
	if _, err := c.Write([]byte("x")); err != nil {
		c.Close()
		e.T.Fatal(err)
	}
	if _, err := io.ReadFull(br, got); err != nil {
		c.Close()
		e.T.Fatal(err)
	}
	return c
}

// EchoServer echoes every connection until it is closed.
func EchoServer(t testing.TB) string {
	t.Helper()
	return ServeTCP(t, func(c net.Conn) { io.Copy(c, c); c.(*net.TCPConn).CloseWrite() })
}

// ServeTCP runs handle for each connection on a loopback listener until
// the test ends.
func ServeTCP(t testing.TB, handle func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := testnet.Serve(ln, handle)
	t.Cleanup(s.Close)
	return s.Addr()
}

func CheckNoLeaks(t *testing.T) { testnet.CheckNoLeaks(t) }

func OnlyOurs(stacks string) string { return testnet.OnlyOurs(stacks) }

func BufioReader(r io.Reader) *bufio.Reader { return bufio.NewReader(r) }

func CertRequestFor(dns string, ips ...string) certs.Request {
	req := certs.Request{CommonName: "server", DNSNames: []string{dns}, Validity: time.Hour}
	for _, ip := range ips {
		req.IPAddresses = append(req.IPAddresses, net.ParseIP(ip))
	}
	return req
}

// LB is a round-robin TCP load balancer on loopback. It can also
// Blackhole: stop forwarding on every open connection without closing any,
// as a dead network path looks.
type LB struct {
	ln net.Listener

	mu       sync.Mutex
	backends []string
	next     int
	conns    map[net.Conn]bool
	frozen   bool
	thaw     chan struct{}

	wg sync.WaitGroup
}

func NewLB(t testing.TB, backends ...string) *LB {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lb := &LB{ln: ln, backends: backends, conns: map[net.Conn]bool{}, thaw: make(chan struct{})}
	lb.wg.Add(1)
	go lb.serve()
	t.Cleanup(lb.close)
	return lb
}

func (lb *LB) Addr() string { return lb.ln.Addr().String() }

func (lb *LB) SetBackends(b ...string) {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	lb.backends = b
}

func (lb *LB) serve() {
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

func (lb *LB) track(cs ...net.Conn) {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	for _, c := range cs {
		lb.conns[c] = true
	}
}

// pipe copies src to dst, pausing (without closing anything) while frozen.
func (lb *LB) pipe(dst, src net.Conn) {
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

// Blackhole stops forwarding on all connections, open and new.
func (lb *LB) Blackhole() {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	lb.frozen = true
}

func (lb *LB) close() {
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

// WaitUntil polls cond until it holds, failing the test after 10s.
func WaitUntil(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not true within 10s: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// WaitStalled waits until every counter has moved and then stood still for
// several polls in a row: the writers behind them are blocked.
func WaitStalled(t *testing.T, what string, counters ...*atomic.Int64) {
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

// IsTimeout reports whether err is a deadline expiry.
func IsTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// HeapInuse returns HeapInuse after a full collection.
func HeapInuse() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// EchoOnce checks that a fresh tunnel to echo carries a round trip.
func (e *Ends) EchoOnce(echo string) error {
	conn, err := net.DialTimeout("unix", e.UDS, 5*time.Second)
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

// DialStatus sends one CONNECT and returns its status and how long it took.
func (e *Ends) DialStatus(addr string) (int, time.Duration, error) {
	start := time.Now()
	conn, err := net.DialTimeout("unix", e.UDS, 5*time.Second)
	if err != nil {
		return 0, 0, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(15 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", addr)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return 0, time.Since(start), err
	}
	return resp.StatusCode, time.Since(start), nil
}

// Metric is the value of one series (its name and labels as the text
// format writes them) in m, or -1 when m has no such series.
func Metric(t testing.TB, m *promtext.Registry, series string) float64 {
	t.Helper()
	var b strings.Builder
	if err := m.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(b.String()) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("series %s: %v", series, err)
			}
			return f
		}
	}
	return -1
}
