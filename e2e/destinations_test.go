package e2e

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// netns is a network namespace the test made: only its own loopback
// device, so every address in it, metadata addresses included, is local
// to it and nothing leaves the machine.
type netns struct {
	name string
	path string
}

// newNetns makes a namespace with lo up and addrs on lo, and writes hosts
// as its /etc/hosts (ip netns exec mounts /etc/netns/NAME/hosts there).
func newNetns(t *testing.T, addrs []string, hosts string) *netns {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a network namespace")
	}
	ipPath, err := exec.LookPath("ip")
	if err != nil {
		t.Skip("needs ip(8) to make a network namespace")
	}
	var rnd [4]byte
	rand.Read(rnd[:])
	ns := &netns{name: "kse2e-" + hex.EncodeToString(rnd[:])}
	ns.path = "/run/netns/" + ns.name
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(ipPath, args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	run("netns", "add", ns.name)
	t.Cleanup(func() {
		exec.Command(ipPath, "netns", "del", ns.name).Run()
		os.RemoveAll("/etc/netns/" + ns.name)
		os.Remove("/etc/netns") // only if no other namespace uses it
	})
	run("-n", ns.name, "link", "set", "lo", "up")
	for _, a := range addrs {
		args := []string{"-n", ns.name, "addr", "add", a, "dev", "lo"}
		if strings.Contains(a, ":") {
			// Usable at once: otherwise an IPv6 address is tentative until
			// the kernel's DAD work runs, which a busy machine delays, and
			// a bind to it fails with "cannot assign requested address".
			args = append(args, "nodad")
		}
		run(args...)
	}
	if hosts != "" {
		dir := "/etc/netns/" + ns.name
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "hosts"), []byte(hosts), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return ns
}

// do runs f with the calling thread in the namespace: sockets f creates
// belong to it for good.
func (ns *netns) do(f func() error) error {
	target, err := os.Open(ns.path)
	if err != nil {
		return err
	}
	defer target.Close()
	runtime.LockOSThread()
	orig, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer orig.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("setns: %w", err)
	}
	ferr := f()
	if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
		// The thread stays in the namespace: leave it locked, so it
		// ends with this goroutine instead of serving others.
		return fmt.Errorf("setns back: %w", err)
	}
	runtime.UnlockOSThread()
	return ferr
}

// dial connects to addr from inside the namespace.
func (ns *netns) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := ns.do(func() error {
		var err error
		c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// trap listens on addr inside the namespace and counts connections; a
// refused destination must never reach one.
type trap struct {
	addr     string
	accepted atomic.Int64
}

func (ns *netns) listen(t *testing.T, addr string, handle func(net.Conn)) *trap {
	t.Helper()
	var ln net.Listener
	if err := ns.do(func() error {
		var err error
		ln, err = net.Listen("tcp", addr)
		return err
	}); err != nil {
		t.Fatalf("listen on %s in the namespace: %v", addr, err)
	}
	tr := &trap{addr: addr}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			tr.accepted.Add(1)
			wg.Add(1)
			go func() { defer wg.Done(); defer c.Close(); handle(c) }()
		}
	}()
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return tr
}

// nsPair is a server and an agent both inside ns; the test reaches the
// server through its Unix socket only.
type nsPair struct {
	server, agent *proc
	sock          string
	agentAdmin    int
	serverAdmin   int
}

func startNsPair(t *testing.T, ns *netns, mode string, agentFlags ...string) *nsPair {
	t.Helper()
	ipPath, _ := exec.LookPath("ip")
	dir, err := os.MkdirTemp("", "kse2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p := newPKI(t, dir)
	// Ports inside the namespace: nothing else listens there.
	agentPort, serverAdmin, agentAdmin := 8132, 8133, 8134
	pr := &nsPair{sock: filepath.Join(dir, "k.sock"), agentAdmin: agentAdmin, serverAdmin: serverAdmin}
	inNs := func(args ...string) []string {
		return append([]string{"netns", "exec", ns.name, konnectivityBin}, args...)
	}
	pr.server = startProcBin(t, ipPath, "server", inNs("server", "--mode="+mode,
		"--uds-name="+pr.sock, "--server-port=0",
		"--agent-bind-address=127.0.0.1", "--agent-port="+strconv.Itoa(agentPort),
		"--cluster-cert="+p.serverCert, "--cluster-key="+p.serverKey, "--cluster-ca-cert="+p.caCert,
		"--health-port=0", "--admin-bind-address=127.0.0.1", "--admin-port="+strconv.Itoa(serverAdmin),
		"--agent-wait=2s", "--backend-dial-timeout=3s", "--graceful-shutdown-timeout=2s")...)
	pr.agent = startProcBin(t, ipPath, "agent", inNs(append([]string{"agent",
		"--proxy-server-host=127.0.0.1", "--proxy-server-port=" + strconv.Itoa(agentPort),
		"--ca-cert=" + p.caCert, "--agent-cert=" + p.agentCert, "--agent-key=" + p.agentKey,
		"--agent-id=a1", "--health-server-port=0",
		"--admin-bind-address=127.0.0.1", "--admin-server-port=" + strconv.Itoa(agentAdmin)}, agentFlags...)...)...)
	deadline := time.Now().Add(startTimeout)
	for {
		if _, err := os.Stat(pr.sock); err == nil {
			break
		}
		if pr.server.exited() || time.Now().After(deadline) {
			t.Fatalf("server socket never appeared\n%s", pr.server.out.String())
		}
		time.Sleep(pollInterval)
	}
	return pr
}

// rawConnect sends a CONNECT over the Unix socket and returns the status
// and body of a refusal.
func rawConnect(t *testing.T, sock, target string) (int, string) {
	t.Helper()
	c, err := net.DialTimeout("unix", sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", target)
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatalf("CONNECT %s: %v", target, err)
	}
	if resp.StatusCode == http.StatusOK {
		return 200, ""
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp.StatusCode, strings.TrimSpace(string(body))
}

// metric returns the value of the sample line that starts with name{labels}.
func (ns *netns) metric(t *testing.T, port int, sample string) string {
	t.Helper()
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: ns.dial}}
	resp, err := client.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	if err != nil {
		t.Fatalf("metrics: %v", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(body), "\n") {
		if v, ok := strings.CutPrefix(line, sample+" "); ok {
			return v
		}
	}
	return "absent"
}

// TestDestinationForms: every form of a destination the agent must not
// dial, through kube-apiserver's own egress dialer, with the server and
// agent in a network namespace whose loopback holds a listener on every
// one of those addresses (metadata addresses included). Each is refused
// (403, or 400 for a request target that is not a valid URI), the reason
// is in the answer and the agent's log, the refusals are counted, and no
// listener sees a connection. Allowed forms of the same host reach it at
// the address that was checked. Then --open-destinations opens exactly
// one metadata address.
func TestDestinationForms(t *testing.T) {
	ns := newNetns(t, []string{
		"169.254.169.254/32", "169.254.170.2/32", "100.100.100.200/32", "168.63.129.16/32",
		"fd00:ec2::254/128", "fd00:ec2::23/128", "fe80::1/64",
	}, "127.0.0.1 localhost\n169.254.169.254 metadata.google.internal\n169.254.170.2 ecs.metadata.test\n0.0.0.0 any.test\n")
	var traps []*trap
	for _, a := range []string{"127.0.0.1:80", "[::1]:80", "169.254.169.254:80", "169.254.170.2:80", "100.100.100.200:80",
		"168.63.129.16:80", "[fd00:ec2::254]:80", "[fd00:ec2::23]:80", "[fe80::1%lo]:80"} {
		traps = append(traps, ns.listen(t, a, func(c net.Conn) {
			// Speaks second: kube-apiserver's dialer refuses bytes that
			// arrive with the CONNECT answer.
			c.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := c.Read(make([]byte, 1)); err == nil {
				io.WriteString(c, "trapped\n")
			}
		}))
	}
	good := ns.listen(t, "127.0.0.1:8080", func(c net.Conn) { io.Copy(c, c) })

	const deny = "--deny-destinations=127.0.0.0/8:1-1000,[::1]:1-1000"
	pr := startNsPair(t, ns, "http-connect", deny)
	d := pr.egressDialerFor(t)
	// Ready once a dial to the allowed listener goes through.
	deadline := time.Now().Add(startTimeout)
	for {
		c, err := d.bounded()(context.Background(), "tcp", "127.0.0.1:8080")
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no tunnel to the allowed listener: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}

	refused := []struct {
		target  string
		code    int
		reason  string
		atAgent bool // refused by the agent (else by the server's front door)
	}{
		{"0.0.0.0:80", 403, "denied by rule 127.0.0.0/8:1-1000", true},
		{"[::]:80", 403, "(the agent's host, dialled as ::1) denied by rule", true},
		{"[::ffff:0.0.0.0]:80", 403, "dialled as 127.0.0.1", true},
		{"[::ffff:127.0.0.1]:80", 403, "denied by rule 127.0.0.0/8:1-1000", true},
		{"[::1]:80", 403, "denied by rule [::1]:1-1000", true},
		{"any.test:80", 403, "denied by rule 127.0.0.0/8:1-1000", true},
		{"[fd00:ec2::254%25lo]:80", 403, "zoned address", false},
		{"[fd00:ec2::254%251]:80", 403, "zoned address", false},
		{"[::1%25lo]:80", 403, "zoned address", false},
		{"[fe80::1%25lo]:80", 403, "zoned address", false},
		{"[fd00:ec2::254%lo]:80", 400, "malformed request", false},
		{"169.254.169.254:80", 403, "built-in rule 169.254.0.0/16", true},
		{"169.254.170.2:80", 403, "built-in rule 169.254.0.0/16", true},
		{"[::ffff:169.254.170.2]:80", 403, "built-in rule 169.254.0.0/16", true},
		{"metadata.google.internal:80", 403, "built-in rule 169.254.0.0/16", true},
		{"ecs.metadata.test:80", 403, "built-in rule 169.254.0.0/16", true},
		{"100.100.100.200:80", 403, "built-in rule 100.100.100.200/32", true},
		{"[::ffff:100.100.100.200]:80", 403, "built-in rule 100.100.100.200/32", true},
		{"168.63.129.16:80", 403, "built-in rule 168.63.129.16/32", true},
		{"[fd00:ec2::254]:80", 403, "built-in rule fd00:ec2::254/128", true},
		{"[fd00:ec2::23]:80", 403, "built-in rule fd00:ec2::23/128", true},
		{"[fe80::1]:80", 403, "built-in rule fe80::/10", true},
	}
	atAgent := 0
	for _, c := range refused {
		_, err := dialErr(t, d, c.target, 10*time.Second)
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("code %d", c.code)) {
			t.Errorf("egress dialer to %s: %v, want code %d", c.target, err, c.code)
		}
		code, body := rawConnect(t, pr.sock, c.target)
		if code != c.code || !strings.Contains(body, c.reason) {
			t.Errorf("CONNECT %s: %d %q, want %d saying %q", c.target, code, body, c.code, c.reason)
		} else {
			t.Logf("CONNECT %-30s %d %s", c.target, code, body)
		}
		if c.atAgent {
			atAgent += 2
		}
	}
	for _, tr := range traps {
		if n := tr.accepted.Load(); n != 0 {
			t.Errorf("the listener on %s got %d connections", tr.addr, n)
		}
	}
	if got := ns.metric(t, pr.agentAdmin, `konnectivity_network_proxy_agent_endpoint_dial_failure_total{reason="denied"}`); got != strconv.Itoa(atAgent) {
		t.Errorf("agent denied count %s, want %d", got, atAgent)
	}
	if got := ns.metric(t, pr.serverAdmin, `konnectivity_network_proxy_server_dial_failure_count{reason="forbidden"}`); got == "absent" || got == "0" {
		t.Errorf("server forbidden count %s", got)
	}
	if out := pr.agent.out.String(); !strings.Contains(out, "dial refused by destination policy") || !strings.Contains(out, "built-in rule 169.254.0.0/16") {
		t.Errorf("the agent's log does not give the reason:\n%s", out)
	}

	// Allowed forms of the local host reach the allowed listener, dialled
	// as 127.0.0.1.
	before := good.accepted.Load()
	for _, target := range []string{"127.0.0.1:8080", "0.0.0.0:8080", "[::ffff:0.0.0.0]:8080", "[::ffff:127.0.0.1]:8080", "any.test:8080"} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, err := d.bounded()(ctx, "tcp", target)
		cancel()
		if err != nil {
			t.Errorf("allowed %s: %v", target, err)
			continue
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		io.WriteString(c, "ping")
		got := make([]byte, 4)
		if _, err := io.ReadFull(c, got); err != nil || string(got) != "ping" {
			t.Errorf("allowed %s: echo %q %v", target, got, err)
		}
		c.Close()
	}
	if n := good.accepted.Load() - before; n != 5 {
		t.Errorf("the allowed listener got %d connections, want 5", n)
	}

	// The same forms through the gRPC front door, with konnectivity-client
	// (kube-apiserver's proxyProtocol GRPC): each DIAL_REQ is answered with
	// the reason. A "%" that is not "%25" is no URI matter here: the
	// address is a zoned one.
	t.Run("grpc", func(t *testing.T) {
		pr.agent.stop(t)
		pr.server.stop(t)
		pr = startNsPair(t, ns, "grpc", deny)
		g := grpcDialer(pr.sock)
		deadline := time.Now().Add(startTimeout)
		for {
			c, err := g(context.Background(), "tcp", "127.0.0.1:8080")
			if err == nil {
				c.Close()
				break
			}
			if pr.agent.exited() || time.Now().After(deadline) {
				t.Fatalf("no gRPC tunnel to the allowed listener: %v", err)
			}
			time.Sleep(200 * time.Millisecond)
		}
		for _, c := range refused {
			reason := c.reason
			if c.code == 400 {
				reason = "zoned address"
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			conn, err := g(ctx, "tcp", c.target)
			cancel()
			if err == nil {
				conn.Close()
			}
			if err == nil || !strings.Contains(err.Error(), reason) {
				t.Errorf("gRPC dial %s: %v, want a refusal saying %q", c.target, err, reason)
			}
		}
		for _, tr := range traps {
			if n := tr.accepted.Load(); n != 0 {
				t.Errorf("the listener on %s got %d connections", tr.addr, n)
			}
		}
	})

	t.Run("open-destinations", func(t *testing.T) {
		pr.agent.stop(t)
		pr.server.stop(t)
		pr2 := startNsPair(t, ns, "http-connect", "--open-destinations=169.254.170.2:80")
		d2 := pr2.egressDialerFor(t)
		ecs := traps[3]
		deadline := time.Now().Add(startTimeout)
		for {
			c, err := d2.bounded()(context.Background(), "tcp", "169.254.170.2:80")
			if err == nil {
				c.SetDeadline(time.Now().Add(5 * time.Second))
				io.WriteString(c, "x")
				line, _ := bufio.NewReader(c).ReadString('\n')
				c.Close()
				if line != "trapped\n" {
					t.Fatalf("opened 169.254.170.2:80 answered %q", line)
				}
				break
			}
			t.Logf("169.254.170.2:80 not reached yet: %v", err)
			if pr2.agent.exited() || time.Now().After(deadline) {
				t.Fatalf("--open-destinations=169.254.170.2:80 did not open it: %v", err)
			}
			time.Sleep(200 * time.Millisecond)
		}
		if ecs.accepted.Load() != 1 {
			t.Errorf("169.254.170.2:80 got %d connections, want 1", ecs.accepted.Load())
		}
		for _, target := range []string{"169.254.169.254:80", "[fd00:ec2::254]:80"} {
			if code, body := rawConnect(t, pr2.sock, target); code != 403 {
				t.Errorf("with 169.254.170.2:80 opened, %s: %d %q, want 403", target, code, body)
			}
		}
		if n := traps[2].accepted.Load() + traps[6].accepted.Load(); n != 0 {
			t.Errorf("an address that was not opened got %d connections", n)
		}
	})
}

// egressDialerFor is kube-apiserver's egress dialer for the pair's socket.
func (pr *nsPair) egressDialerFor(t *testing.T) dialFunc {
	s := &server{dir: filepath.Dir(pr.sock), sock: pr.sock}
	return s.egressDialer(t)
}
