package e2e

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/pem"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	apiserverapi "k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/server/egressselector"

	"github.com/spinifex/konnectivity/e2e/internal/benchpki"
)

// Bounds used by the harness. They are upper limits for things that normally
// take milliseconds, not performance expectations.
const (
	startTimeout = 15 * time.Second // process up and ready
	stopTimeout  = 5 * time.Second  // SIGTERM → exit, before SIGKILL
	pollInterval = 50 * time.Millisecond
)

// konnectivityBin is the binary under test, set once by TestMain.
var konnectivityBin string

func TestMain(m *testing.M) {
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	// A re-executed copy of this binary running as another user (see
	// runAsUID) does one small job and exits.
	if job := os.Getenv(helperEnv); job != "" {
		return runHelper(job)
	}
	if bin := os.Getenv("KONNECTIVITY_BIN"); bin != "" {
		abs, err := filepath.Abs(bin)
		if err != nil {
			fmt.Fprintf(os.Stderr, "e2e: KONNECTIVITY_BIN %s: %v\n", bin, err)
			return 1
		}
		if _, err := os.Stat(abs); err != nil {
			fmt.Fprintf(os.Stderr, "e2e: KONNECTIVITY_BIN: %v\n", err)
			return 1
		}
		konnectivityBin = abs
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "konnectivity-e2e-bin")
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: temp dir: %v\n", err)
		return 1
	}
	defer os.RemoveAll(dir)
	konnectivityBin = filepath.Join(dir, "konnectivity")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// Build the main module exactly as shipped: static, no local paths.
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", konnectivityBin, ".")
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: building konnectivity from ..: %v\n%s", err, out)
		return 1
	}
	return m.Run()
}

// ---------------------------------------------------------------------------
// Throwaway PKI

type pki struct {
	caCert, caKey, serverCert, serverKey, agentCert, agentKey string // file paths
}

// newPKI writes a CA, a serving certificate for localhost, 127.0.0.1, ::1
// and extraIPs, and an agent client certificate into dir.
func newPKI(t *testing.T, dir string, extraIPs ...net.IP) *pki {
	t.Helper()
	bp, err := benchpki.MintSpec(dir, benchpki.Spec{
		CAName:    "konnectivity-e2e-ca",
		AgentName: "konnectivity-agent",
		DNSNames:  serverDNSNames(),
		IPs:       append([]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}, extraIPs...),
	})
	if err != nil {
		t.Fatalf("mint PKI: %v", err)
	}
	return &pki{caCert: bp.CACert, caKey: bp.CAKey, serverCert: bp.ServerCert, serverKey: bp.ServerKey, agentCert: bp.AgentCert, agentKey: bp.AgentKey}
}

func newKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatalf("generate key: %v", err)
	}
	return k
}

func writePEM(t *testing.T, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
}

// ---------------------------------------------------------------------------
// Processes

// lockedBuffer collects a process's combined output.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

type proc struct {
	name    string
	args    []string
	cmd     *exec.Cmd
	out     *lockedBuffer
	done    chan struct{} // closed when the process has been reaped
	waitErr error         // valid after done is closed
}

// startProc starts the binary under test; t.Cleanup stops it and, if the
// test failed, logs its output.
func startProc(t *testing.T, name string, args ...string) *proc {
	t.Helper()
	return startProcBin(t, konnectivityBin, name, args...)
}

// startProcBin is startProc for another path to the binary (a symlink).
func startProcBin(t *testing.T, bin, name string, args ...string) *proc {
	t.Helper()
	return startProcEnv(t, bin, name, nil, args...)
}

// startProcEnv is startProcBin with env added to the inherited environment.
func startProcEnv(t *testing.T, bin, name string, env []string, args ...string) *proc {
	t.Helper()
	return startProcOut(t, bin, name, env, nil, args...)
}

// startProcOut is startProcEnv with the process's standard output and
// error on out, when it is not nil, instead of collected in proc.out.
func startProcOut(t *testing.T, bin, name string, env []string, out *os.File, args ...string) *proc {
	t.Helper()
	p := newProc(bin, name, args...)
	if len(env) > 0 {
		p.cmd.Env = append(os.Environ(), env...)
	}
	if out != nil {
		p.cmd.Stdout, p.cmd.Stderr = out, out
	}
	p.start(t, func() {
		if t.Failed() || testing.Verbose() && os.Getenv("E2E_LOG_PROCS") != "" {
			t.Logf("--- %s: %s %s\n%s--- end %s (%v)", name, bin,
				strings.Join(args, " "), p.out.String(), name, p.waitErr)
		}
	})
	return p
}

// newProc is a process not started yet, its output collected in out.
func newProc(bin, name string, args ...string) *proc {
	p := &proc{name: name, args: args, out: &lockedBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout = p.out
	p.cmd.Stderr = p.out
	return p
}

// start starts p and the goroutine that reaps it; t.Cleanup stops it and
// then calls report, which may log its output.
func (p *proc) start(t *testing.T, report func()) {
	t.Helper()
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", p.name, err)
	}
	go func() {
		p.waitErr = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.stop(t)
		report()
	})
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop ends the process: SIGCONT (it may have been stopped by a test),
// SIGTERM, then SIGKILL after stopTimeout.
func (p *proc) stop(t *testing.T) {
	if p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGCONT)
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	start := time.Now()
	select {
	case <-p.done:
		return
	case <-time.After(stopTimeout):
	}
	t.Logf("%s did not exit within %v of SIGTERM; sending SIGKILL", p.name, time.Since(start).Round(time.Millisecond))
	_ = p.cmd.Process.Kill()
	<-p.done
}

func (p *proc) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("signal %v to %s: %v", sig, p.name, err)
	}
}

// freeze sends SIGSTOP and waits until every thread of the process has
// stopped: kill returns once the signal is queued, and the threads that
// did not take it run on (and may answer a dial) until the one that did
// gets a CPU, which on a busy machine can be much later.
func (p *proc) freeze(t *testing.T) {
	t.Helper()
	p.signal(t, syscall.SIGSTOP)
	pid := p.cmd.Process.Pid
	waitFor(t, 10*time.Second, p.name+" stopped by SIGSTOP", func() bool { return threadsStopped(pid) })
}

// threadsStopped reports whether every thread of pid is in the stopped
// state (T in /proc/PID/task/TID/stat).
func threadsStopped(pid int) bool {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		if err != nil {
			return false
		}
		i := bytes.LastIndexByte(b, ')') // the command name may hold spaces and parentheses
		if i < 0 || i+2 >= len(b) || b[i+2] != 'T' {
			return false
		}
	}
	return true
}

// waitHTTP polls url until it returns want, failing the test after
// startTimeout or if the process exits.
func waitHTTP(t *testing.T, p *proc, url string, want int) {
	t.Helper()
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(startTimeout)
	var last string
	for {
		if p.exited() {
			t.Fatalf("%s exited while waiting for %s: %v\n%s", p.name, url, p.waitErr, p.out.String())
		}
		resp, err := client.Get(url)
		if err == nil {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode == want {
				return
			}
			last = fmt.Sprintf("status %d body %q", resp.StatusCode, body)
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s never returned %d within %v; last: %s", p.name, url, want, startTimeout, last)
		}
		time.Sleep(pollInterval)
	}
}

func getStatus(t *testing.T, url string) int {
	t.Helper()
	client := &http.Client{Timeout: 3 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

// freePort returns a port that was free on 127.0.0.1 a moment ago.
// freePort returns a loopback port for a process to listen on. It is
// picked below the kernel's ephemeral range (32768 and up), so an outgoing
// connection cannot take it before the process binds it, and never handed
// out twice in one test run.
func freePort(t *testing.T) int {
	t.Helper()
	givenPorts.Lock()
	defer givenPorts.Unlock()
	for range 1000 {
		port := 20000 + mrand.IntN(12000)
		if givenPorts.m[port] {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		l.Close()
		givenPorts.m[port] = true
		return port
	}
	t.Fatal("no free loopback port found")
	return 0
}

// givenPorts remembers the ports freePort handed out in this test binary.
var givenPorts = struct {
	sync.Mutex
	m map[int]bool
}{m: map[int]bool{}}

// ---------------------------------------------------------------------------
// Server and agents

type server struct {
	proc       *proc
	bin        string   // executable; "" is konnectivityBin
	env        []string // added to the test's environment
	stdio      *os.File // standard output and error; nil: collected in proc.out
	args       []string
	owner      *testing.T // the test whose cleanup stops every server process
	dir        string
	pki        *pki
	sock       string // unix frontend, or ""
	serverPort int    // TCP mTLS frontend, or 0
	agentPort  int
	healthPort int
	adminPort  int
}

// startServer starts an http-connect server on a fresh unix socket and
// waits until its /healthz answers. extra flags are appended (later
// flags override earlier ones in the Go flag package).
func startServer(t *testing.T, extra ...string) *server {
	t.Helper()
	return startServerWith(t, frontendUDS, extra...)
}

// frontend selects how kube-apiserver reaches the server.
type frontend int

const (
	frontendUDS frontend = iota // --uds-name, no TLS (the usual setup)
	frontendTCP                 // --server-port with mTLS
)

func startServerWith(t *testing.T, fe frontend, extra ...string) *server {
	t.Helper()
	return startServerBin(t, "", fe, extra...)
}

// startServerBin is startServerWith for another executable (a copy the
// test replaces); "" is konnectivityBin.
func startServerBin(t *testing.T, bin string, fe frontend, extra ...string) *server {
	t.Helper()
	return startServerBinEnv(t, bin, nil, fe, extra...)
}

// startServerBinEnv is startServerBin with env added to the server's
// environment.
func startServerBinEnv(t *testing.T, bin string, env []string, fe frontend, extra ...string) *server {
	t.Helper()
	s := newServerSpec(t, bin, env, fe, extra...)
	s.launch(t)
	return s
}

// newServerSpec is startServerBinEnv before the launch.
func newServerSpec(t *testing.T, bin string, env []string, fe frontend, extra ...string) *server {
	t.Helper()
	// Unix socket paths are limited to ~108 bytes; t.TempDir can be long.
	dir, err := os.MkdirTemp("", "kse2e")
	if err != nil {
		t.Fatalf("temp dir: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s := &server{
		owner:      t,
		bin:        bin,
		env:        env,
		dir:        dir,
		pki:        newPKI(t, dir),
		agentPort:  freePort(t),
		healthPort: freePort(t),
		adminPort:  freePort(t),
	}
	args := []string{"server", "--mode=http-connect"}
	switch fe {
	case frontendUDS:
		s.sock = filepath.Join(dir, "k.sock")
		args = append(args, "--uds-name="+s.sock, "--server-port=0")
	case frontendTCP:
		s.serverPort = freePort(t)
		args = append(args,
			"--server-bind-address=127.0.0.1",
			"--server-port="+strconv.Itoa(s.serverPort),
			"--server-cert="+s.pki.serverCert,
			"--server-key="+s.pki.serverKey,
			"--server-ca-cert="+s.pki.caCert,
		)
	}
	args = append(args,
		"--agent-bind-address=127.0.0.1",
		"--agent-port="+strconv.Itoa(s.agentPort),
		"--cluster-cert="+s.pki.serverCert,
		"--cluster-key="+s.pki.serverKey,
		"--cluster-ca-cert="+s.pki.caCert,
		"--health-bind-address=127.0.0.1",
		"--health-port="+strconv.Itoa(s.healthPort),
		"--admin-bind-address=127.0.0.1",
		"--admin-port="+strconv.Itoa(s.adminPort),
		"--agent-wait=2s",
		"--backend-dial-timeout=3s",
		"--graceful-shutdown-timeout=2s",
	)
	s.args = append(args, extra...)
	return s
}

// launch starts the server process with s.args and waits for /healthz and
// the frontend socket.
func (s *server) launch(t *testing.T) {
	t.Helper()
	// Registered with the owner so that a restart inside a subtest
	// outlives that subtest.
	bin := s.bin
	if bin == "" {
		bin = konnectivityBin
	}
	s.proc = startProcOut(s.owner, bin, "server", s.env, s.stdio, s.args...)
	waitHTTP(t, s.proc, s.healthURL("/healthz"), http.StatusOK)
	// The frontend must be up once the server reports healthy.
	deadline := time.Now().Add(startTimeout)
	for {
		if s.sock == "" {
			c, err := net.DialTimeout("tcp", s.frontendAddr(), time.Second)
			if err == nil {
				c.Close()
				break
			}
		} else if _, err := os.Stat(s.sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("server healthy but frontend %s%s never appeared", s.sock, s.frontendAddr())
		}
		time.Sleep(pollInterval)
	}
}

func (s *server) frontendAddr() string {
	if s.serverPort == 0 {
		return ""
	}
	return "127.0.0.1:" + strconv.Itoa(s.serverPort)
}

func (s *server) healthURL(path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d%s", s.healthPort, path)
}

type agent struct {
	proc       *proc
	id         string
	healthPort int
	adminPort  int
}

// startAgent starts an agent against s and waits until the agent reports
// ready (connected to the server) and the server reports ready.
func (s *server) startAgent(t *testing.T, id, identifiers string, extra ...string) *agent {
	t.Helper()
	a := s.launchAgent(t, s.pki, id, identifiers, extra...)
	waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
	waitHTTP(t, s.proc, s.healthURL("/readyz"), http.StatusOK)
	return a
}

// launchAgent starts an agent that presents the client certificate from
// certs (trusting s's CA) and returns without waiting for it.
func (s *server) launchAgent(t *testing.T, certs *pki, id, identifiers string, extra ...string) *agent {
	t.Helper()
	return s.launchAgentEnv(t, nil, certs, id, identifiers, extra...)
}

// launchAgentEnv is launchAgent with env added to the agent's environment.
func (s *server) launchAgentEnv(t *testing.T, env []string, certs *pki, id, identifiers string, extra ...string) *agent {
	t.Helper()
	return s.launchAgentFrom(t, konnectivityBin, env, certs, id, identifiers, extra...)
}

// launchAgentFrom is launchAgentEnv running the binary at bin, such as a
// private copy that SIGHUP re-executes while the shared one may be
// rebuilt.
func (s *server) launchAgentFrom(t *testing.T, bin string, env []string, certs *pki, id, identifiers string, extra ...string) *agent {
	t.Helper()
	return s.launchAgentOut(t, bin, env, nil, certs, id, identifiers, extra...)
}

// launchAgentOut is launchAgentFrom with the agent's standard output and
// error on out, when it is not nil (startProcOut).
func (s *server) launchAgentOut(t *testing.T, bin string, env []string, out *os.File, certs *pki, id, identifiers string, extra ...string) *agent {
	t.Helper()
	a := &agent{id: id, healthPort: freePort(t), adminPort: freePort(t)}
	args := []string{
		"agent",
		"--proxy-server-host=127.0.0.1",
		"--proxy-server-port=" + strconv.Itoa(s.agentPort),
		"--ca-cert=" + s.pki.caCert,
		"--agent-cert=" + certs.agentCert,
		"--agent-key=" + certs.agentKey,
		"--agent-id=" + id,
		"--health-server-host=127.0.0.1",
		"--health-server-port=" + strconv.Itoa(a.healthPort),
		"--admin-bind-address=127.0.0.1",
		"--admin-server-port=" + strconv.Itoa(a.adminPort),
	}
	if identifiers != "" {
		args = append(args, "--agent-identifiers="+identifiers)
	}
	a.proc = startProcOut(t, bin, "agent-"+id, env, out, append(args, extra...)...)
	return a
}

func (a *agent) healthURL(path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d%s", a.healthPort, path)
}

// ---------------------------------------------------------------------------
// kube-apiserver's egress dialer

type dialFunc func(ctx context.Context, network, addr string) (net.Conn, error)

// egressDialer builds the "cluster" dialer exactly as kube-apiserver does
// from --egress-selector-config-file: read, validate, NewEgressSelector,
// Lookup(Cluster). It speaks HTTPConnect over the server's frontend (UDS,
// or TCP with the test PKI's client certificate).
func (s *server) egressDialer(t *testing.T) dialFunc {
	t.Helper()
	return s.egressDialerProto(t, apiserverapi.ProtocolHTTPConnect)
}

func (s *server) egressDialerProto(t *testing.T, proto apiserverapi.ProtocolType) dialFunc {
	t.Helper()
	var transport string
	if s.sock != "" {
		transport = fmt.Sprintf(`
      uds:
        udsName: %s`, s.sock)
	} else {
		// kube-apiserver's client certificate for the frontend: any
		// client-auth certificate from the CA in --server-ca-cert.
		transport = fmt.Sprintf(`
      tcp:
        url: https://%s
        tlsConfig:
          caBundle: %s
          clientCert: %s
          clientKey: %s`, s.frontendAddr(), s.pki.caCert, s.pki.agentCert, s.pki.agentKey)
	}
	cfg := fmt.Sprintf(`apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: %s
    transport:%s
- name: controlplane
  connection:
    proxyProtocol: Direct
- name: etcd
  connection:
    proxyProtocol: Direct
`, proto, transport)
	cfgPath := filepath.Join(s.dir, "egress-selector.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatalf("write egress config: %v", err)
	}
	config, err := egressselector.ReadEgressSelectorConfiguration(cfgPath)
	if err != nil {
		t.Fatalf("ReadEgressSelectorConfiguration: %v\n%s", err, cfg)
	}
	if errs := egressselector.ValidateEgressSelectorConfiguration(config); len(errs) > 0 {
		t.Fatalf("ValidateEgressSelectorConfiguration: %v\n%s", errs.ToAggregate(), cfg)
	}
	// Guard against a silently ignored config: the cluster selection must
	// have decoded to what we wrote.
	var found bool
	for _, sel := range config.EgressSelections {
		if sel.Name == "cluster" {
			c := sel.Connection
			found = c.ProxyProtocol == proto && c.Transport != nil &&
				(s.sock != "" && c.Transport.UDS != nil && c.Transport.UDS.UDSName == s.sock ||
					s.sock == "" && c.Transport.TCP != nil && c.Transport.TCP.URL == "https://"+s.frontendAddr())
		}
	}
	if !found {
		t.Fatalf("egress config did not decode to what was written: %+v\n%s", config, cfg)
	}
	sel, err := egressselector.NewEgressSelector(config)
	if err != nil {
		t.Fatalf("NewEgressSelector: %v", err)
	}
	d, err := sel.Lookup(egressselector.Cluster.AsNetworkContext())
	if err != nil || d == nil {
		t.Fatalf("Lookup(cluster): dialer %v, err %v", d != nil, err)
	}
	return dialFunc(d)
}

// bounded wraps d so that a dial returns once ctx is done. The egress
// dialer ignores ctx while it waits for the CONNECT response (a known
// kube-apiserver limitation), so without this a hung server would hang the
// test. A late result is closed; the abandoned goroutine ends at the latest
// when the server process is stopped and the socket closes.
func (d dialFunc) bounded() dialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		type result struct {
			c   net.Conn
			err error
		}
		ch := make(chan result, 1)
		go func() {
			c, err := d(ctx, network, addr)
			ch <- result{c, err}
		}()
		select {
		case r := <-ch:
			return r.c, r.err
		case <-ctx.Done():
			go func() {
				if r := <-ch; r.c != nil {
					r.c.Close()
				}
			}()
			return nil, fmt.Errorf("dial %s via konnectivity: no CONNECT answer: %w", addr, ctx.Err())
		}
	}
}

// httpClient returns a client whose every connection is a konnectivity
// tunnel made by d. keepAlive=false makes every request a fresh tunnel.
func (d dialFunc) httpClient(keepAlive bool, dials *int64counter) *http.Client {
	bd := d.bounded()
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if dials != nil {
				dials.add(1)
			}
			return bd(ctx, network, addr)
		},
		DisableKeepAlives:   !keepAlive,
		MaxIdleConnsPerHost: 64,
		ForceAttemptHTTP2:   false,
	}
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

type int64counter struct {
	mu sync.Mutex
	n  int64
}

func (c *int64counter) add(d int64) {
	c.mu.Lock()
	c.n += d
	c.mu.Unlock()
}

func (c *int64counter) get() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// dialErr dials addr through d with a bound and returns the error (nil if
// the dial unexpectedly succeeded, after closing the conn) and the time
// taken.
func dialErr(t *testing.T, d dialFunc, addr string, bound time.Duration) (time.Duration, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	start := time.Now()
	c, err := d.bounded()(ctx, "tcp", addr)
	el := time.Since(start)
	if err == nil {
		c.Close()
	}
	return el, err
}
