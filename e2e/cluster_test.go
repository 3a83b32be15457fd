package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Helpers for tests with several servers and agents that share one PKI,
// and for a TCP proxy the tests control (load balancer, blackhole, break).

// serverOpts describes one server process of a multi-process test.
type serverOpts struct {
	pki       *pki
	agentBind string // default 127.0.0.1
	agentPort int    // default a free port
	// certFile and keyFile override pki's serving pair (--cluster-cert/-key).
	certFile, keyFile string
	// clusterCA is --cluster-ca-cert; "" omits the flag (token-only auth).
	clusterCA string
	extra     []string
}

// startServerOpts starts an http-connect server on its own unix socket with
// the given certificates and agent listener, and waits for /healthz.
func startServerOpts(t *testing.T, o serverOpts) *server {
	t.Helper()
	dir, err := os.MkdirTemp("", "kse2e")
	if err != nil {
		t.Fatalf("temp dir: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if o.agentBind == "" {
		o.agentBind = "127.0.0.1"
	}
	if o.agentPort == 0 {
		o.agentPort = freePort(t)
	}
	if o.certFile == "" {
		o.certFile, o.keyFile = o.pki.serverCert, o.pki.serverKey
	}
	s := &server{
		owner:      t,
		dir:        dir,
		pki:        o.pki,
		sock:       filepath.Join(dir, "k.sock"),
		agentPort:  o.agentPort,
		healthPort: freePort(t),
		adminPort:  freePort(t),
	}
	s.args = []string{"server", "--mode=http-connect",
		"--uds-name=" + s.sock, "--server-port=0",
		"--agent-bind-address=" + o.agentBind,
		"--agent-port=" + strconv.Itoa(s.agentPort),
		"--cluster-cert=" + o.certFile,
		"--cluster-key=" + o.keyFile,
		"--health-bind-address=127.0.0.1",
		"--health-port=" + strconv.Itoa(s.healthPort),
		"--admin-bind-address=127.0.0.1",
		"--admin-port=" + strconv.Itoa(s.adminPort),
		"--agent-wait=2s",
		"--backend-dial-timeout=3s",
		"--graceful-shutdown-timeout=2s",
	}
	if o.clusterCA != "" {
		s.args = append(s.args, "--cluster-ca-cert="+o.clusterCA)
	}
	s.args = append(s.args, o.extra...)
	s.launch(t)
	return s
}

// setArg replaces the value of --name in s.args (for a restart with a
// changed flag).
func (s *server) setArg(name, value string) {
	for i, a := range s.args {
		if strings.HasPrefix(a, "--"+name+"=") {
			s.args[i] = "--" + name + "=" + value
			return
		}
	}
	s.args = append(s.args, "--"+name+"="+value)
}

// startAgentArgs starts an agent with its own health and admin ports, the
// given ID and args (server address, credentials, ...), without waiting.
func startAgentArgs(t *testing.T, id string, args ...string) *agent {
	t.Helper()
	a := &agent{id: id, healthPort: freePort(t), adminPort: freePort(t)}
	all := append([]string{
		"agent",
		"--agent-id=" + id,
		"--health-server-host=127.0.0.1",
		"--health-server-port=" + strconv.Itoa(a.healthPort),
		"--admin-bind-address=127.0.0.1",
		"--admin-server-port=" + strconv.Itoa(a.adminPort),
	}, args...)
	a.proc = startProc(t, "agent-"+id, all...)
	return a
}

// mtlsAgentArgs are the flags of an agent that dials host:port, trusts
// p's CA and presents p's agent certificate.
func mtlsAgentArgs(p *pki, host string, port int) []string {
	return []string{
		"--proxy-server-host=" + host,
		"--proxy-server-port=" + strconv.Itoa(port),
		"--ca-cert=" + p.caCert,
		"--agent-cert=" + p.agentCert,
		"--agent-key=" + p.agentKey,
	}
}

// fetch GETs url and returns status and body.
func fetch(url string) (int, string, error) {
	client := &http.Client{Timeout: 2 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, string(body), err
}

// waitReadyBody polls url until it answers want with a body containing
// substr, failing after bound or if p exits. It returns the time it took.
func waitReadyBody(t *testing.T, p *proc, url string, want int, substr string, bound time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	var last string
	for {
		if p.exited() {
			t.Fatalf("%s exited while waiting for %s: %v", p.name, url, p.waitErr)
		}
		code, body, err := fetch(url)
		if err == nil && code == want && strings.Contains(body, substr) {
			return time.Since(start)
		}
		last = fmt.Sprintf("status %d body %q err %v", code, body, err)
		if time.Since(start) > bound {
			t.Fatalf("%s: %s never answered %d with %q within %v; last: %s", p.name, url, want, substr, bound, last)
		}
		time.Sleep(pollInterval)
	}
}

var agentsRE = regexp.MustCompile(`(\d+) agent\(s\) connected`)

// agentCount is the number of agents s reports in /readyz?verbose (0 when
// none or unreachable).
func (s *server) agentCount() int {
	_, body, err := fetch(s.healthURL("/readyz?verbose"))
	if err != nil {
		return 0
	}
	m := agentsRE.FindStringSubmatch(body)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// waitAgents waits until s reports exactly n agents and returns how long
// that took.
func (s *server) waitAgents(t *testing.T, n int, bound time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		if s.proc.exited() {
			t.Fatalf("server exited while waiting for %d agents: %v", n, s.proc.waitErr)
		}
		got := s.agentCount()
		if got == n {
			return time.Since(start)
		}
		if time.Since(start) > bound {
			t.Fatalf("server reports %d agents, want %d, after %v", got, n, bound)
		}
		time.Sleep(pollInterval)
	}
}

// ---------------------------------------------------------------------------
// Dial loop: load while something changes underneath.

// dialLoop sends requests, one new tunnel each, through every dialer in
// turn until stopped, counting successes and failures.
type dialLoop struct {
	ok, failed atomic.Int64
	mu         sync.Mutex
	errs       []string
	stop       chan struct{}
	done       chan struct{}
}

func startDialLoop(t *testing.T, backend, name string, dialers ...dialFunc) *dialLoop {
	t.Helper()
	l := &dialLoop{stop: make(chan struct{}), done: make(chan struct{})}
	clients := make([]*http.Client, len(dialers))
	for i, d := range dialers {
		clients[i] = d.httpClient(false, nil)
	}
	go func() {
		defer close(l.done)
		for i := 0; ; i++ {
			select {
			case <-l.stop:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			err := getHello(ctx, clients[i%len(clients)], backend, name, i)
			cancel()
			if err != nil {
				l.failed.Add(1)
				l.mu.Lock()
				if len(l.errs) < 5 {
					l.errs = append(l.errs, fmt.Sprintf("request %d via dialer %d at %s: %v",
						i, i%len(clients), time.Now().Format("15:04:05.000"), err))
				}
				l.mu.Unlock()
				continue
			}
			l.ok.Add(1)
		}
	}()
	t.Cleanup(l.halt)
	return l
}

func (l *dialLoop) halt() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	<-l.done
}

// finish stops the loop and fails t if any request failed or none ran.
func (l *dialLoop) finish(t *testing.T, what string) {
	t.Helper()
	l.halt()
	ok, failed := l.ok.Load(), l.failed.Load()
	t.Logf("%s: %d requests ok, %d failed", what, ok, failed)
	if failed > 0 {
		t.Errorf("%s: %d of %d requests failed; first: %s", what, failed, ok+failed, strings.Join(l.errs, "; "))
	}
	if ok == 0 {
		t.Errorf("%s: no request completed", what)
	}
}

// ---------------------------------------------------------------------------
// TCP proxy

// tcpProxy forwards each accepted connection to the next backend, round
// robin. It can stop forwarding without closing anything (blackhole) and
// can cut every open connection (cut).
type tcpProxy struct {
	l        net.Listener
	accepted atomic.Int64
	hole     atomic.Bool

	mu       sync.Mutex
	backends []string
	next     int
	conns    map[net.Conn]struct{}

	closed chan struct{}
	wg     sync.WaitGroup
}

func startProxy(t *testing.T, backends ...string) *tcpProxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("proxy listen: %v", err)
	}
	p := &tcpProxy{l: l, backends: backends, conns: map[net.Conn]struct{}{}, closed: make(chan struct{})}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(p.close)
	return p
}

func (p *tcpProxy) port() int { return p.l.Addr().(*net.TCPAddr).Port }

func (p *tcpProxy) setBackends(b ...string) {
	p.mu.Lock()
	p.backends = b
	p.mu.Unlock()
}

func (p *tcpProxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
		p.mu.Lock()
		backend := p.backends[p.next%len(p.backends)]
		p.next++
		p.mu.Unlock()
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.pipe(c, backend)
		}()
	}
}

// track adds c to the open set; false if the proxy is closed.
func (p *tcpProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conns == nil {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *tcpProxy) untrack(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conns != nil {
		delete(p.conns, c)
	}
}

func (p *tcpProxy) pipe(c net.Conn, backend string) {
	defer c.Close()
	if !p.track(c) {
		return
	}
	defer p.untrack(c)
	// A backend that is down: close the client, as a TCP balancer does.
	b, err := net.DialTimeout("tcp", backend, 2*time.Second)
	if err != nil {
		return
	}
	defer b.Close()
	if !p.track(b) {
		return
	}
	defer p.untrack(b)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.copy(b, c) }()
	go func() { defer wg.Done(); p.copy(c, b) }()
	wg.Wait()
}

// copy forwards src to dst. Once the proxy is a blackhole nothing more is
// forwarded, not even a close: the goroutine parks until the proxy closes.
func (p *tcpProxy) copy(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if p.hole.Load() {
			<-p.closed
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				src.Close()
				return
			}
		}
		if err != nil {
			dst.Close()
			return
		}
	}
}

// blackhole stops all forwarding; connections stay open.
func (p *tcpProxy) blackhole() { p.hole.Store(true) }

// cut closes every open connection (both sides) at once.
func (p *tcpProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
}

func (p *tcpProxy) close() {
	p.l.Close()
	p.mu.Lock()
	select {
	case <-p.closed:
	default:
		close(p.closed)
	}
	for c := range p.conns {
		c.Close()
	}
	p.conns = nil
	p.mu.Unlock()
	p.wg.Wait()
}

// canListen reports whether every ip can be bound (127/8 beyond 127.0.0.1
// is routed to loopback on Linux, not everywhere).
func canListen(ips ...string) error {
	for _, ip := range ips {
		l, err := net.Listen("tcp", ip+":0")
		if err != nil {
			return err
		}
		l.Close()
	}
	return nil
}

// freePortOn returns a port free on every one of ips a moment ago.
func freePortOn(t *testing.T, ips ...string) int {
	t.Helper()
	for range 20 {
		port := freePort(t)
		free := true
		for _, ip := range ips {
			l, err := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(port)))
			if err != nil {
				free = false
				break
			}
			l.Close()
		}
		if free {
			return port
		}
	}
	t.Fatal(errors.New("no port free on all of " + strings.Join(ips, ",")))
	return 0
}
