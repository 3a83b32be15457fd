package tunnel

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/certs"
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

// env is one server with its frontend socket and agent listener, all on
// loopback, torn down by t.Cleanup.
type env struct {
	t         testing.TB
	pki       *pki
	srv       *Server
	uds       string
	agentAddr string
	wg        sync.WaitGroup
	once      sync.Once
	stopOnce  func()
}

func newEnv(t testing.TB, mutate func(*ServerConfig)) *env {
	t.Helper()
	return newEnvOn(t, newPKI(t), "127.0.0.1:0", mutate)
}

// newEnvOn starts a server whose agent listener is on agentAddr, with the
// given PKI, so several servers can share one CA.
func newEnvOn(t testing.TB, p *pki, agentAddr string, mutate func(*ServerConfig)) *env {
	t.Helper()
	cfg := ServerConfig{
		ID:          "s1",
		AgentTLS:    &tls.Config{Certificates: []tls.Certificate{p.serverCert}, ClientCAs: p.pool, ClientAuth: tls.RequireAndVerifyClientCert},
		AgentWait:   500 * time.Millisecond,
		DialTimeout: 3 * time.Second,
		Logger:      testLogger(t),
	}
	if mutate != nil {
		mutate(&cfg)
	}
	srv, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "tun")
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, pki: p, srv: srv, uds: filepath.Join(dir, "s.sock")}
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
func (e *env) stop() {
	e.once.Do(e.stopOnce)
}

// testAgent is an in-process agent and the means to stop it.
type testAgent struct {
	*Agent
	cancel context.CancelFunc
	done   chan struct{}
}

func (a *testAgent) stop() {
	a.cancel()
	<-a.done
}

// kill drops the agent's connections abruptly, then stops it.
func (a *testAgent) kill() {
	a.closeConns()
	a.stop()
}

func (e *env) startAgent(id, identifiers string, mutate func(*AgentConfig)) *testAgent {
	e.t.Helper()
	return startAgentTo(e.t, e.pki, []string{e.agentAddr}, id, identifiers, mutate)
}

func startAgentTo(t testing.TB, p *pki, addrs []string, id, identifiers string, mutate func(*AgentConfig)) *testAgent {
	t.Helper()
	cfg := AgentConfig{
		ServerAddrs:  addrs,
		ID:           id,
		Identifiers:  identifiers,
		DrainTimeout: 2 * time.Second,
		SyncInterval: 20 * time.Millisecond,
		SyncCap:      100 * time.Millisecond,
		Logger:       testLogger(t),
		TLS: func(name string) (*tls.Config, error) {
			return &tls.Config{RootCAs: p.pool, ServerName: name, Certificates: []tls.Certificate{p.agentCert}}, nil
		},
	}
	if mutate != nil {
		mutate(&cfg)
	}
	a, err := NewAgent(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ta := &testAgent{Agent: a, cancel: cancel, done: make(chan struct{})}
	go func() { defer close(ta.done); a.Run(ctx) }()
	t.Cleanup(ta.stop)
	return ta
}

// waitAgents waits until the server has n agents.
func (e *env) waitAgents(n int) {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for e.srv.AgentCount() != n {
		if time.Now().After(deadline) {
			e.t.Fatalf("server has %d agents, want %d", e.srv.AgentCount(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// connect sends a CONNECT the way kube-apiserver does and returns the
// connection, the reader positioned after the answer, and its status.
func (e *env) connect(addr string) (net.Conn, *bufio.Reader, *http.Response) {
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

// newEchoEnv is a server with one agent and an echo destination, whose
// address it returns. The caller stops the env.
func newEchoEnv(tb testing.TB) (*env, string) {
	e := newEnv(tb, nil)
	e.startAgent("a1", "", nil)
	e.waitAgents(1)
	return e, echoServer(tb)
}

// echoOne opens a tunnel to an echo destination and sends one byte there
// and back; it returns the open tunnel.
func (e *env) echoOne(addr string) net.Conn {
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

// serveTCP runs handle for each connection on a loopback listener.
func serveTCP(t testing.TB, handle func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				handle(c)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

// checkNoLeaks fails the test if goroutines started during it are still
// running once everything has been closed.
func checkNoLeaks(t *testing.T) {
	t.Helper()
	base := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for {
			n := runtime.NumGoroutine()
			if n <= base {
				return
			}
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Errorf("goroutines: %d at start, %d after cleanup\n%s", base, n, onlyOurs(string(buf)))
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

func onlyOurs(stacks string) string {
	var keep []string
	for _, g := range strings.Split(stacks, "\n\n") {
		if strings.Contains(g, "konnectivity") || strings.Contains(g, "http2") {
			keep = append(keep, g)
		}
	}
	return strings.Join(keep, "\n\n")
}

func bufioReader(r io.Reader) *bufio.Reader { return bufio.NewReader(r) }

func certRequestFor(dns string, ips ...string) certs.Request {
	req := certs.Request{CommonName: "server", DNSNames: []string{dns}, Validity: time.Hour}
	for _, ip := range ips {
		req.IPAddresses = append(req.IPAddresses, net.ParseIP(ip))
	}
	return req
}
