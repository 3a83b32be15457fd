package e2e

import (
	"bufio"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/testnet"
)

// Faults with real processes: kill -9, a throttled link, file-descriptor
// exhaustion, stalled readers. Each ends with the server's goroutines and
// open files back near where they started.

// faultConnect sends a CONNECT on the server's Unix socket, the way
// kube-apiserver does, and returns the answer's status (0 if none came
// within bound).
func faultConnect(sock, addr string, bound time.Duration) (net.Conn, *bufio.Reader, int, string, error) {
	c, err := net.DialTimeout("unix", sock, bound)
	if err != nil {
		return nil, nil, 0, "", err
	}
	c.SetDeadline(time.Now().Add(bound))
	if _, err := fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", addr); err != nil {
		c.Close()
		return nil, nil, 0, "", err
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		c.Close()
		return nil, nil, 0, "", err
	}
	if resp.StatusCode != 200 {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		c.Close()
		return nil, nil, resp.StatusCode, strings.TrimSpace(string(body)), nil
	}
	c.SetDeadline(time.Time{})
	return c, br, 200, "", nil
}

// faultGoroutines reads the total from /debug/pprof/goroutine?debug=1.
func faultGoroutines(t *testing.T, adminPort int) goroutineCount {
	t.Helper()
	g, err := goroutines(adminPort)
	if err != nil {
		t.Fatalf("goroutine profile: %v", err)
	}
	return g
}

func faultFDCount(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatalf("open files of %d: %v", pid, err)
	}
	return len(ents)
}

func faultRSSKiB(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatalf("status of %d: %v", pid, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	t.Fatalf("no VmRSS for %d", pid)
	return 0
}

// faultBaseline is a process's goroutines and open files at rest.
type faultBaseline struct {
	name       string
	pid, admin int
	goroutines int // ours (goroutineCount.ours)
	files      int
}

func takeFaultBaseline(t *testing.T, name string, pid, admin int) faultBaseline {
	t.Helper()
	return faultBaseline{name: name, pid: pid, admin: admin, goroutines: faultGoroutines(t, admin).ours(), files: faultFDCount(t, pid)}
}

// backNear waits until the process is back within slack goroutines and
// files of its faultBaseline, and logs what it saw.
func (b faultBaseline) backNear(t *testing.T, slackG, slackF int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		g, f := faultGoroutines(t, b.admin), faultFDCount(t, b.pid)
		// A pooled connection is a socket too.
		if g.ours() <= b.goroutines+slackG && g.conns <= maxPooledConns && f-g.conns <= b.files+slackF {
			t.Logf("%s back at rest: %s, ours %d (faultBaseline %d), open files %d (faultBaseline %d)", b.name, g, g.ours(), b.goroutines, f, b.files)
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s not back at rest after 10s: %s, ours %d (faultBaseline %d), open files %d (faultBaseline %d)", b.name, g, g.ours(), b.goroutines, f, b.files)
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// faultFirehose is a destination that writes until the connection closes and
// counts what it wrote.
type faultFirehose struct {
	addr    string
	written atomic.Int64
	open    atomic.Int64
}

func startFaultFirehose(t *testing.T, host string) *faultFirehose {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatalf("listen %s: %v", host, err)
	}
	f := &faultFirehose{addr: l.Addr().String()}
	srv := testnet.Serve(l, func(c net.Conn) {
		f.open.Add(1)
		defer f.open.Add(-1)
		buf := make([]byte, 32<<10)
		for {
			n, err := c.Write(buf)
			f.written.Add(int64(n))
			if err != nil {
				return
			}
		}
	})
	t.Cleanup(srv.Close)
	return f
}

var faultProfiling = []string{"--enable-profiling"}

// kill -9 an agent in the middle of transfers: its tunnels end on the
// client side within the keepalive bound, the other agent's tunnels go on,
// and new dials for its destinations go to the other agent.
func TestFaultAgentKill9(t *testing.T) {
	if err := canListen("127.0.0.2", "127.0.0.3"); err != nil {
		t.Skipf("needs 127.0.0.2 and 127.0.0.3: %v", err)
	}
	fast := []string{"--keepalive-time=1s", "--ping-timeout=1s", "--enable-profiling"}
	s := startServer(t, append(fast, "--proxy-strategies=destHost,default")...)
	a := s.startAgent(t, "a", "ipv4=127.0.0.2", fast...)
	b := s.startAgent(t, "b", "ipv4=127.0.0.3", fast...)
	s.waitAgents(t, 2, 10*time.Second)
	destA, destB := startFaultFirehose(t, "127.0.0.2"), startFaultFirehose(t, "127.0.0.3")
	base := takeFaultBaseline(t, "server", s.proc.cmd.Process.Pid, s.adminPort)
	baseB := takeFaultBaseline(t, "agent b", b.proc.cmd.Process.Pid, b.adminPort)

	type tun struct {
		c  net.Conn
		br *bufio.Reader
	}
	open := func(addr string) tun {
		c, br, code, body, err := faultConnect(s.sock, addr, 5*time.Second)
		if err != nil || code != 200 {
			t.Fatalf("CONNECT %s: %d %s %v", addr, code, body, err)
		}
		if _, err := io.CopyN(io.Discard, br, 1<<20); err != nil {
			t.Fatalf("first MiB from %s: %v", addr, err)
		}
		return tun{c, br}
	}
	var viaA, viaB []tun
	for range 3 {
		viaA = append(viaA, open(destA.addr))
		viaB = append(viaB, open(destB.addr))
	}
	defer func() {
		for _, x := range append(viaA, viaB...) {
			x.c.Close()
		}
	}()
	// Keep the A tunnels draining so "ended" means the tunnel ended, not a
	// full buffer.
	const bound = 1*time.Second + 1*time.Second + 2*time.Second // keepalive + ping timeout + slack
	ended := make(chan string, len(viaA))
	killed := time.Now()
	for _, x := range viaA {
		go func() {
			x.c.SetReadDeadline(time.Now().Add(bound + 5*time.Second))
			_, err := io.Copy(io.Discard, x.br)
			ended <- fmt.Sprintf("%s after %s", faultErrText(err), time.Since(killed).Round(time.Millisecond))
		}()
	}
	if err := a.proc.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-a.proc.done
	for range viaA {
		select {
		case how := <-ended:
			if strings.HasPrefix(how, "timeout") {
				t.Errorf("tunnel through the killed agent did not end: %s", how)
			} else {
				t.Logf("tunnel through the killed agent ended: %s", how)
			}
		case <-time.After(bound + 6*time.Second):
			t.Fatal("tunnel through the killed agent still open")
		}
	}
	for i, x := range viaB {
		x.c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.CopyN(io.Discard, x.br, 1<<20); err != nil {
			t.Errorf("tunnel %d through the surviving agent: %v", i, err)
		}
	}
	s.waitAgents(t, 1, 10*time.Second)
	for range 5 {
		c, _, code, body, err := faultConnect(s.sock, destA.addr, 5*time.Second)
		if err != nil || code != 200 {
			t.Fatalf("new dial for the killed agent's destination: %d %s %v", code, body, err)
		}
		c.Close()
	}
	for _, x := range append(viaA, viaB...) {
		x.c.Close()
	}
	base.backNear(t, 5, 2)
	baseB.backNear(t, 5, 2)
}

func faultErrText(err error) string {
	switch {
	case err == nil:
		return "EOF"
	case errors.Is(err, os.ErrDeadlineExceeded):
		return "timeout"
	default:
		return err.Error()
	}
}

// kill -9 the server: open tunnels end at once, new dials fail at once with
// a clear error (no hang), and when the server is back the agent reconnects
// by itself and dials work again.
func TestFaultServerKill9(t *testing.T) {
	s := startServer(t, faultProfiling...)
	a := s.startAgent(t, "a", "", faultProfiling...)
	echo := startHTTPBackend(t, "127.0.0.1", "k9")
	c, br, code, _, err := faultConnect(s.sock, echo, 5*time.Second)
	if err != nil || code != 200 {
		t.Fatalf("CONNECT: %d %v", code, err)
	}
	defer c.Close()
	if err := s.proc.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-s.proc.done
	killed := time.Now()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = br.ReadByte()
	t.Logf("open tunnel after kill -9 of the server: %s after %s", faultErrText(err), time.Since(killed).Round(time.Millisecond))
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatal("open tunnel hung after the server was killed")
	}
	// New dials: a raw CONNECT and kube-apiserver's own dialer.
	start := time.Now()
	_, _, _, _, err = faultConnect(s.sock, echo, 5*time.Second)
	t.Logf("raw CONNECT while the server is down: %v after %s", err, time.Since(start).Round(time.Millisecond))
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("raw CONNECT while down: %v, want connection refused", err)
	}
	took, err := dialErr(t, s.egressDialer(t), echo, 5*time.Second)
	t.Logf("kube-apiserver's dialer while the server is down: %v after %s", err, took.Round(time.Millisecond))
	if err == nil || took > time.Second {
		t.Errorf("egress dial while down: %v after %s, want a prompt error", err, took)
	}
	waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusServiceUnavailable)
	// Back: the agent reconnects on its own.
	s.launch(t)
	back := time.Now()
	waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
	t.Logf("agent /readyz back to 200 %s after the server restarted", time.Since(back).Round(time.Millisecond))
	client := s.egressDialer(t).httpClient(false, nil)
	resp, err := client.Get("http://" + echo + "/hello?i=1")
	if err != nil {
		t.Fatalf("after the server came back: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "hello k9 1" {
		t.Fatalf("body %q", body)
	}
}

// faultThrottle forwards between a listener and a backend at rate bytes per
// second in each direction (shared by all connections), as a slow WAN link.
type faultThrottle struct {
	l       net.Listener
	backend string
	rate    float64
	mu      sync.Mutex
	next    [2]time.Time // when each direction may send again
	wg      sync.WaitGroup
	conns   sync.Map
}

func startFaultThrottle(t *testing.T, backend string, rate float64) *faultThrottle {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	th := &faultThrottle{l: l, backend: backend, rate: rate}
	th.wg.Add(1)
	go func() {
		defer th.wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			b, err := net.Dial("tcp", backend)
			if err != nil {
				c.Close()
				continue
			}
			th.conns.Store(c, true)
			th.conns.Store(b, true)
			th.wg.Add(2)
			go th.pipe(b, c, 0)
			go th.pipe(c, b, 1)
		}
	}()
	t.Cleanup(func() {
		l.Close()
		th.conns.Range(func(k, _ any) bool { k.(net.Conn).Close(); return true })
		th.wg.Wait()
	})
	return th
}

func (th *faultThrottle) port() int { return th.l.Addr().(*net.TCPAddr).Port }

func (th *faultThrottle) pipe(dst, src net.Conn, dir int) {
	defer th.wg.Done()
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 8<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			th.mu.Lock()
			now := time.Now()
			at := th.next[dir]
			if at.Before(now) {
				at = now
			}
			th.next[dir] = at.Add(time.Duration(float64(n) / th.rate * float64(time.Second)))
			th.mu.Unlock()
			time.Sleep(time.Until(at))
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// A 1 MiB/s link between agent and server: a download takes as long as
// the link needs, arrives intact, and a small dial still gets through.
func TestFaultThrottledLink(t *testing.T) {
	s := startServer(t, faultProfiling...)
	const rate = 1 << 20
	th := startFaultThrottle(t, fmt.Sprintf("127.0.0.1:%d", s.agentPort), rate)
	a := startAgentArgs(t, "slow", append(mtlsAgentArgs(s.pki, "127.0.0.1", th.port()), faultProfiling...)...)
	waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
	backend := startHTTPBackend(t, "127.0.0.1", "slow")
	base := takeFaultBaseline(t, "server", s.proc.cmd.Process.Pid, s.adminPort)
	client := s.egressDialer(t).httpClient(false, nil)
	client.Timeout = 60 * time.Second

	const size = 3 << 20
	type result struct {
		took time.Duration
		err  error
	}
	big := make(chan result, 1)
	start := time.Now()
	go func() {
		resp, err := client.Get(fmt.Sprintf("http://%s/big?n=%d", backend, size))
		if err != nil {
			big <- result{err: err}
			return
		}
		defer resp.Body.Close()
		h := sha256.New()
		n, err := io.Copy(h, resp.Body)
		if err == nil && (n != size || fmt.Sprintf("%x", h.Sum(nil)) != sha(pattern(size))) {
			err = fmt.Errorf("got %d bytes, checksum match %v", n, fmt.Sprintf("%x", h.Sum(nil)) == sha(pattern(size)))
		}
		big <- result{time.Since(start), err}
	}()
	time.Sleep(500 * time.Millisecond)
	smallStart := time.Now()
	resp, err := client.Get("http://" + backend + "/hello?i=7")
	if err != nil {
		t.Fatalf("small request during the download: %v", err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	small := time.Since(smallStart)
	r := <-big
	if r.err != nil {
		t.Fatalf("download over the throttled link: %v", r.err)
	}
	mibps := float64(size) / (1 << 20) / r.took.Seconds()
	t.Logf("%d MiB over a %d MiB/s link in %s (%.2f MiB/s); a small request meanwhile took %s",
		size>>20, rate>>20, r.took.Round(time.Millisecond), mibps, small.Round(time.Millisecond))
	if mibps > 1.3*float64(rate)/(1<<20) {
		t.Errorf("%.2f MiB/s through a %d MiB/s link: the faultThrottle is not in the path", mibps, rate>>20)
	}
	base.backNear(t, 5, 2)
}

// The server under `ulimit -n 64`, asked for many more tunnels than it has
// descriptors: it must not crash or wedge, the dials it cannot serve must
// end in a way the client sees, and once the tunnels close it serves
// every dial, the first one too.
func TestFaultFileDescriptorExhaustion(t *testing.T) {
	dir := t.TempDir()
	wrapper := filepath.Join(dir, "limited")
	script := "#!/bin/sh\nulimit -n 64 || exit 1\nexec " + konnectivityBin + " \"$@\"\n"
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	s := startServerBin(t, wrapper, frontendUDS, "--enable-profiling", "--agent-wait=1s")
	pid := s.proc.cmd.Process.Pid
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid)); err != nil || !strings.Contains(string(b), "Max open files            64 ") {
		t.Fatalf("the server does not run with 64 descriptors: %v\n%s", err, b)
	}
	s.startAgent(t, "a", "")
	dest := startFaultFirehose(t, "127.0.0.1")
	base := takeFaultBaseline(t, "server", pid, s.adminPort)
	t.Logf("server at rest: %d open files of 64", base.files)

	const dials = 100
	const bound = 5 * time.Second
	type outcome struct {
		c    net.Conn
		what string
	}
	out := make(chan outcome, dials)
	for range dials {
		go func() {
			c, _, code, body, err := faultConnect(s.sock, dest.addr, bound)
			switch {
			case err != nil && errors.Is(err, os.ErrDeadlineExceeded):
				out <- outcome{what: "no answer within " + bound.String()}
			case err != nil:
				out <- outcome{what: "error: " + err.Error()}
			case code == 200:
				out <- outcome{c: c, what: "200"}
			default:
				out <- outcome{what: fmt.Sprintf("%d %s", code, body)}
			}
		}()
	}
	counts := map[string]int{}
	var held []net.Conn
	for range dials {
		o := <-out
		counts[o.what]++
		if o.c != nil {
			held = append(held, o.c)
		}
	}
	t.Logf("%d concurrent dials against 64 descriptors: %v", dials, counts)
	if s.proc.exited() {
		t.Fatalf("server died: %v", s.proc.waitErr)
	}
	if counts["200"] == 0 || counts["200"] == dials {
		t.Errorf("expected some dials served and some not: %v", counts)
	}
	// Out of descriptors, the server gives up a spare descriptor to accept
	// and answer each waiting dial with 503 at once: none is left hanging.
	if n := counts["no answer within "+bound.String()]; n > 0 {
		t.Errorf("%d dials beyond the descriptor limit got no answer within %s instead of a prompt 503", n, bound)
	}
	if code, _, err := fetch(s.healthURL("/healthz")); err != nil || code != 200 {
		t.Logf("healthz while out of descriptors: %d %v", code, err)
	}
	for _, c := range held {
		c.Close()
	}
	// Once the tunnels are gone, every dial is served, the first one too:
	// a refusal says what the descriptors are now, not what they were
	// when the storm ended.
	waitFor(t, 10*time.Second, "the server's descriptors back at rest", func() bool { return faultFDCount(t, pid) <= base.files })
	const after = 50
	served := 0
	for i := range after {
		c, _, code, body, err := faultConnect(s.sock, dest.addr, bound)
		if err != nil || code != 200 {
			t.Errorf("dial %d of %d after the storm: %d %s %v", i+1, after, code, body, err)
			continue
		}
		c.Close()
		served++
	}
	t.Logf("after the storm, with the descriptors back at rest: %d of %d dials served", served, after)
	if s.proc.exited() {
		t.Fatalf("server died: %v", s.proc.waitErr)
	}
	base.backNear(t, 5, 2)
}

// Ten tunnels whose client never reads while the destination writes as
// fast as it can: the server's and the agent's memory stay within what
// the windows allow, and the destination is held back (it cannot write
// more than the windows and socket buffers take).
func TestFaultStalledClientMemoryBounded(t *testing.T) {
	s := startServer(t, faultProfiling...)
	a := s.startAgent(t, "a", "", faultProfiling...)
	dest := startFaultFirehose(t, "127.0.0.1")
	spid, apid := s.proc.cmd.Process.Pid, a.proc.cmd.Process.Pid
	// Warm both processes up with one short transfer so the faultBaseline
	// includes the pools and buffers any tunnel uses.
	if c, br, code, _, err := faultConnect(s.sock, dest.addr, 5*time.Second); err == nil && code == 200 {
		io.CopyN(io.Discard, br, 8<<20)
		c.Close()
	}
	time.Sleep(300 * time.Millisecond)
	base := takeFaultBaseline(t, "server", spid, s.adminPort)
	baseA := takeFaultBaseline(t, "agent", apid, a.adminPort)
	rss0, arss0 := faultRSSKiB(t, spid), faultRSSKiB(t, apid)
	const tunnels = 10
	var conns []net.Conn
	for range tunnels {
		c, _, code, body, err := faultConnect(s.sock, dest.addr, 5*time.Second)
		if err != nil || code != 200 {
			t.Fatalf("CONNECT: %d %s %v", code, body, err)
		}
		conns = append(conns, c) // never read
	}
	time.Sleep(3 * time.Second)
	w1 := dest.written.Load()
	time.Sleep(time.Second)
	w2 := dest.written.Load()
	rss1, arss1 := faultRSSKiB(t, spid), faultRSSKiB(t, apid)
	for _, c := range conns {
		c.Close()
	}
	// Per tunnel the server holds at most its 1 MiB stream window and a
	// 128 KiB copy buffer, the agent a copy buffer and a frame; twice that
	// for garbage-collector headroom, plus 8 MiB for runtime noise.
	const perTunnelServer, perTunnelAgent = (1<<20 + 128<<10) >> 10, (128<<10 + 64<<10) >> 10
	serverBound := 2*tunnels*perTunnelServer + 8<<10
	agentBound := 2*tunnels*perTunnelAgent + 8<<10
	t.Logf("%d stalled tunnels for 4s: destination wrote %.1f MiB per tunnel, then %d KiB in the last second; RSS growth: server %d KiB (bound %d), agent %d KiB (bound %d)",
		tunnels, float64(w2)/tunnels/(1<<20), (w2-w1)>>10, rss1-rss0, serverBound, arss1-arss0, agentBound)
	if rss1-rss0 > serverBound {
		t.Errorf("server RSS grew %d KiB, bound %d KiB", rss1-rss0, serverBound)
	}
	if arss1-arss0 > agentBound {
		t.Errorf("agent RSS grew %d KiB, bound %d KiB", arss1-arss0, agentBound)
	}
	if w2-w1 > 1<<20 {
		t.Errorf("the destination kept writing (%d KiB in the last second): nothing holds it back", (w2-w1)>>10)
	}
	if w2/tunnels > 32<<20 {
		t.Errorf("%d MiB per stalled tunnel were accepted from the destination", w2/tunnels>>20)
	}
	base.backNear(t, 5, 2)
	baseA.backNear(t, 5, 2)
}

// The soak (e2e/soak) for 25 seconds: mixed load, two server restarts,
// agent churn; fails on a lost byte or a leak.
func TestSoakShort(t *testing.T) {
	if testing.Short() {
		t.Skip("runs for ~30s")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "run", "./soak", "--bin", konnectivityBin,
		"--duration", "25s", "--interval", "5s", "--hup-every", "10s", "--churn-every", "8s")
	out, err := cmd.CombinedOutput()
	t.Logf("soak output:\n%s", out)
	if err != nil {
		t.Fatalf("soak: %v", err)
	}
	if !strings.Contains(string(out), "SOAK PASSED") {
		t.Fatal("soak did not report a pass")
	}
}
