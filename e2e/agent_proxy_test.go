package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// proxiedServerName is a server name no resolver knows: only the test's own
// proxy, which maps it to 127.0.0.1, reaches the server by it.
const proxiedServerName = "server.konnectivity.test"

// serverDNSNames are the names the test server certificate carries:
// localhost, proxiedServerName and the host's own name (which hosts often
// resolve to a loopback address; see loopbackHostname).
func serverDNSNames() []string {
	names := []string{"localhost", proxiedServerName}
	if h, err := os.Hostname(); err == nil && h != "localhost" && isDNSName(h) {
		names = append(names, h)
	}
	return names
}

// isDNSName accepts letters, digits, '-' and '.', which every certificate
// tool takes as a DNS name.
func isDNSName(h string) bool {
	if h == "" {
		return false
	}
	for _, c := range h {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '.') {
			return false
		}
	}
	return true
}

// loopbackHostname returns the host's name when it resolves to 127.0.0.1
// and nothing else, "" otherwise. The proxy environment never proxies
// "localhost" or a loopback address, so a real forward proxy (which
// resolves names itself) can reach a loopback server only by such a name.
func loopbackHostname() string {
	h, err := os.Hostname()
	if err != nil || h == "localhost" || !isDNSName(h) {
		return ""
	}
	addrs, err := net.LookupHost(h)
	if err != nil || len(addrs) == 0 {
		return ""
	}
	for _, a := range addrs {
		if a != "127.0.0.1" {
			return ""
		}
	}
	return h
}

// forwardProxy is an HTTP proxy the agent is sent through.
type forwardProxy interface {
	url(user string) string // http://[user@]host:port
	connects() int          // CONNECT requests it has received
}

// ---------------------------------------------------------------------------
// A CONNECT proxy of the test's own, for what no packaged proxy is told to
// do (answer nothing), and for hosts where tinyproxy is missing.

type proxyMode int32

const (
	proxyPass   proxyMode = iota // connect to the target
	proxyRefuse                  // 403
	proxySilent                  // read the request, never answer
)

type testProxy struct {
	ln    net.Listener
	mode  proxyMode
	count atomic.Int64
	auth  atomic.Value   // string: the last Proxy-Authorization
	wg    sync.WaitGroup // the accept goroutine and one per connection

	mu    sync.Mutex
	conns map[net.Conn]struct{} // guarded by mu: both ends of every connection, closed by close; nil once closed
}

// startTestProxy runs a CONNECT proxy on loopback until the test ends. It
// reaches proxiedServerName at 127.0.0.1, as a proxy with its own DNS would.
func startTestProxy(t *testing.T, mode proxyMode) *testProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &testProxy{ln: ln, mode: mode, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if !p.track(c) {
				return
			}
			p.wg.Add(1)
			go func() { defer p.wg.Done(); p.serve(c) }()
		}
	}()
	t.Cleanup(p.close)
	return p
}

func (p *testProxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conns == nil {
		c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *testProxy) close() {
	p.ln.Close()
	p.mu.Lock()
	for c := range p.conns {
		c.Close()
	}
	p.conns = nil
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *testProxy) url(user string) string {
	if user != "" {
		user += "@"
	}
	return "http://" + user + p.ln.Addr().String()
}

func (p *testProxy) connects() int { return int(p.count.Load()) }

func (p *testProxy) serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil || req.Method != http.MethodConnect {
		return
	}
	p.count.Add(1)
	p.auth.Store(req.Header.Get("Proxy-Authorization"))
	switch p.mode {
	case proxyRefuse:
		io.WriteString(c, "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		return
	case proxySilent:
		io.Copy(io.Discard, c) // until the agent gives up, or close
		return
	}
	host, port, err := net.SplitHostPort(req.Host)
	if err != nil {
		return
	}
	if host == proxiedServerName {
		host = "127.0.0.1"
	}
	up, err := net.DialTimeout("tcp", net.JoinHostPort(host, port), 5*time.Second)
	if err != nil {
		io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
		return
	}
	if !p.track(up) {
		return
	}
	defer up.Close()
	io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n")
	done := make(chan struct{})
	go func() {
		defer close(done)
		io.Copy(up, br)
		up.(*net.TCPConn).CloseWrite()
	}()
	io.Copy(c, up)
	c.Close()
	<-done
}

// ---------------------------------------------------------------------------
// tinyproxy, run as a child process with a configuration of the test's own.

type tinyproxy struct {
	addr string
	log  string // its log file: one "Request ... CONNECT" line per request
}

// startTinyproxy runs tinyproxy on loopback, allowing CONNECT to
// connectPort only (any other port gets its 403 "Access violation").
func startTinyproxy(t *testing.T, connectPort int) *tinyproxy {
	t.Helper()
	bin, err := exec.LookPath("tinyproxy")
	if err != nil {
		t.Skip("tinyproxy not installed (apt-get install tinyproxy)")
	}
	dir := t.TempDir()
	port := freePort(t)
	tp := &tinyproxy{addr: "127.0.0.1:" + strconv.Itoa(port), log: filepath.Join(dir, "tinyproxy.log")}
	conf := filepath.Join(dir, "tinyproxy.conf")
	if err := os.WriteFile(conf, fmt.Appendf(nil, "Port %d\nListen 127.0.0.1\nTimeout 60\nLogFile %q\nLogLevel Connect\nMaxClients 20\nAllow 127.0.0.1\nConnectPort %d\nDisableViaHeader Yes\n",
		port, tp.log, connectPort), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startProcBin(t, bin, "tinyproxy", "-d", "-c", conf)
	waitFor(t, startTimeout, "tinyproxy listening", func() bool {
		if p.exited() {
			t.Fatalf("tinyproxy exited: %v\n%s", p.waitErr, p.out.String())
		}
		c, err := net.DialTimeout("tcp", tp.addr, time.Second)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	return tp
}

func (tp *tinyproxy) url(user string) string {
	if user != "" {
		user += "@"
	}
	return "http://" + user + tp.addr
}

var tinyproxyConnect = regexp.MustCompile(`Request \(file descriptor \d+\): CONNECT `)

func (tp *tinyproxy) connects() int {
	b, _ := os.ReadFile(tp.log)
	return len(tinyproxyConnect.FindAll(b, -1))
}

// ---------------------------------------------------------------------------

// proxyEnv is the agent's proxy environment, in both spellings.
func proxyEnv(proxy, noProxy string) []string {
	return []string{"HTTPS_PROXY=" + proxy, "https_proxy=" + proxy, "NO_PROXY=" + noProxy, "no_proxy=" + noProxy}
}

// TestAgentEgressProxy: an agent whose node reaches the control plane only
// through an HTTP proxy (HTTPS_PROXY) connects to its server through it; NO_PROXY
// sends it direct; a refusing proxy is a clear error naming the proxy and
// its status (never its credentials) and is retried; a proxy that never
// answers is bounded by the connection's timeout and retried; a proxy the
// agent cannot use ends its start.
func TestAgentEgressProxy(t *testing.T) {
	s := startServer(t)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	agentPort := strconv.Itoa(s.agentPort)
	retries := []string{"--sync-interval=100ms", "--sync-interval-cap=500ms"}

	// A real forward proxy resolves the server's name itself: tinyproxy
	// when the host's name reaches loopback, else the test's own proxy.
	name, real := loopbackHostname(), true
	if name == "" || exec.Command("tinyproxy", "-v").Run() != nil {
		name, real = proxiedServerName, false
	}
	startProxy := func(t *testing.T, mode proxyMode) forwardProxy {
		if !real || mode == proxySilent {
			return startTestProxy(t, mode)
		}
		port := s.agentPort
		if mode == proxyRefuse {
			port = 1 // tinyproxy refuses CONNECT to any other port with 403
		}
		return startTinyproxy(t, port)
	}
	serverAddr := net.JoinHostPort(name, agentPort)
	t.Logf("server reached as %s; forward proxy: tinyproxy=%v", serverAddr, real)

	t.Run("through-proxy", func(t *testing.T) {
		p := startProxy(t, proxyPass)
		a := s.launchAgentEnv(t, proxyEnv(p.url("node1:s3cret"), ""), s.pki, "a1", "",
			append(retries, "--proxy-server-host="+name)...)
		waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
		if p.connects() == 0 {
			t.Fatal("the agent is connected but the proxy saw no CONNECT")
		}
		if tp, ok := p.(*testProxy); ok {
			if auth, _ := tp.auth.Load().(string); auth != "Basic bm9kZTE6czNjcmV0" { // node1:s3cret
				t.Errorf("Proxy-Authorization %q, want the URL's credentials", auth)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		body, err := get(ctx, s.egressDialer(t).httpClient(false, nil), "http://"+backend+"/hello?i=1")
		if err != nil || body != "hello b1 1" {
			t.Fatalf("request through the tunnel: %q, %v", body, err)
		}
		out := a.proc.out.String()
		route := fmt.Sprintf(`msg="server route" server=%s proxy=%s`, serverAddr, p.url(""))
		if !strings.Contains(out, route) {
			t.Errorf("agent log lacks %q:\n%s", route, out)
		}
		if strings.Contains(out, "s3cret") {
			t.Errorf("agent log carries the proxy password:\n%s", out)
		}
	})

	t.Run("no-proxy", func(t *testing.T) {
		p := startProxy(t, proxyPass)
		domain := name
		if i := strings.IndexByte(name, '.'); i > 0 {
			domain = name[i:] // a domain covers its hosts
		}
		a := s.launchAgentEnv(t, proxyEnv(p.url(""), "10.0.0.0/8,"+domain), s.pki, "a2", "",
			append(retries, "--proxy-server-host="+name)...)
		route := fmt.Sprintf(`msg="server route" server=%s proxy=direct`, serverAddr)
		if real {
			// The name resolves here: the direct connection succeeds.
			waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
		} else {
			// Only the proxy knows the name: the direct dial fails to resolve it.
			waitFor(t, 30*time.Second, "a direct dial failing", func() bool {
				return strings.Contains(a.proc.out.String(), "server connection failed")
			})
		}
		if !strings.Contains(a.proc.out.String(), route) {
			t.Errorf("agent log lacks %q:\n%s", route, a.proc.out.String())
		}
		if n := p.connects(); n != 0 {
			t.Errorf("NO_PROXY names the server, yet the proxy saw %d CONNECTs", n)
		}
	})

	t.Run("refused", func(t *testing.T) {
		p := startProxy(t, proxyRefuse)
		a := s.launchAgentEnv(t, proxyEnv(p.url("node1:s3cret"), ""), s.pki, "a3", "",
			append(retries, "--proxy-server-host="+name)...)
		want := regexp.MustCompile(`msg="server connection failed" server=` + regexp.QuoteMeta(serverAddr) +
			` err="dial server [^"]*: proxy ` + regexp.QuoteMeta(p.url("")) + `, CONNECT [^"]*: refused: 403 `)
		waitFor(t, 30*time.Second, "the refusal logged and retried", func() bool {
			return want.MatchString(a.proc.out.String()) && p.connects() >= 2
		})
		if st := getStatus(t, a.healthURL("/readyz")); st == http.StatusOK {
			t.Errorf("agent ready with its proxy refusing")
		}
		if strings.Contains(a.proc.out.String(), "s3cret") {
			t.Errorf("agent log carries the proxy password:\n%s", a.proc.out.String())
		}
	})

	t.Run("unusable", func(t *testing.T) {
		a := s.launchAgentEnv(t, proxyEnv("socks5://node1:s3cret@127.0.0.1:1080", ""), s.pki, "a5", "",
			"--proxy-server-host="+name)
		select {
		case <-a.proc.done:
		case <-time.After(startTimeout):
			t.Fatal("agent with a socks5 proxy did not end its start")
		}
		out := a.proc.out.String()
		if a.proc.cmd.ProcessState.ExitCode() != 2 || !strings.Contains(out, `proxy socks5://127.0.0.1:1080 for `) ||
			!strings.Contains(out, "not supported") || strings.Contains(out, "s3cret") {
			t.Errorf("exit %d; want 2 and the proxy named without its password:\n%s", a.proc.cmd.ProcessState.ExitCode(), out)
		}
	})

	t.Run("silent", func(t *testing.T) {
		p := startProxy(t, proxySilent)
		start := time.Now()
		a := s.launchAgentEnv(t, proxyEnv(p.url(""), ""), s.pki, "a4", "",
			append(retries, "--proxy-server-host="+name)...)
		// The agent bounds a connection to a server, TLS and login
		// included, at 15 s; the CONNECT is part of it.
		want := regexp.MustCompile(`msg="server connection failed" server=` + regexp.QuoteMeta(serverAddr) +
			` err="dial server [^"]*: proxy ` + regexp.QuoteMeta(p.url("")) + `, CONNECT [^"]*: read reply: [^"]*deadline exceeded`)
		waitFor(t, 40*time.Second, "the silent proxy timed out and retried", func() bool {
			return want.MatchString(a.proc.out.String()) && p.connects() >= 2
		})
		if took := time.Since(start); took < 14*time.Second {
			t.Errorf("gave up on the silent proxy after %v, before the 15 s bound", took)
		}
		a.proc.signal(t, syscall.SIGTERM) // a waiting CONNECT does not hold up the exit
		select {
		case <-a.proc.done:
		case <-time.After(stopTimeout):
			t.Errorf("agent did not exit within %v of SIGTERM while its CONNECT waited", stopTimeout)
		}
	})
}
