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
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	apiserverapi "k8s.io/apiserver/pkg/apis/apiserver"
)

// Self-restart in place (docs/restart.md, "Re-executing in place"):
// SIGHUP or a replaced executable re-executes the process with the same
// PID and the same listening sockets.

// restartLoad runs workers that each loop: new tunnel through
// kube-apiserver's dialer, one GET, close. Every failure is kept with its
// time so it can be placed relative to the signals.
type restartLoad struct {
	ok       atomic.Int64
	mu       sync.Mutex
	failures []loadFailure
	stop     chan struct{}
	wg       sync.WaitGroup
}

type loadFailure struct {
	at     time.Time
	worker int
	req    int
	err    error
}

func startRestartLoad(t *testing.T, d dialFunc, backend, name string, workers int) *restartLoad {
	t.Helper()
	l := &restartLoad{stop: make(chan struct{})}
	for w := range workers {
		client := d.httpClient(false, nil)
		l.wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-l.stop:
					return
				default:
				}
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				err := getHello(ctx, client, backend, name, i)
				cancel()
				if err != nil {
					l.mu.Lock()
					l.failures = append(l.failures, loadFailure{time.Now(), w, i, err})
					l.mu.Unlock()
					continue
				}
				l.ok.Add(1)
			}
		})
	}
	t.Cleanup(l.halt)
	return l
}

func (l *restartLoad) halt() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	l.wg.Wait()
}

// finish stops the load and fails t if any request failed, naming each
// failure's time relative to the last signal before it.
func (l *restartLoad) finish(t *testing.T, what string, signals []time.Time) {
	t.Helper()
	l.halt()
	l.mu.Lock()
	defer l.mu.Unlock()
	t.Logf("%s: %d requests ok, %d failed", what, l.ok.Load(), len(l.failures))
	if l.ok.Load() == 0 {
		t.Errorf("%s: no request completed", what)
	}
	for i, f := range l.failures {
		if i == 10 {
			t.Errorf("... and %d more", len(l.failures)-i)
			break
		}
		t.Errorf("%s: worker %d request %d failed %s: %v", what, f.worker, f.req, relativeTo(f.at, signals), f.err)
	}
}

// relativeTo says when at happened relative to the signals (sent in order).
func relativeTo(at time.Time, signals []time.Time) string {
	last := -1
	for i, s := range signals {
		if !at.Before(s) {
			last = i
		}
	}
	if last < 0 {
		if len(signals) == 0 {
			return "with no signal sent"
		}
		return fmt.Sprintf("%v before the first signal", signals[0].Sub(at).Round(time.Millisecond))
	}
	return fmt.Sprintf("%v after signal #%d", at.Sub(signals[last]).Round(time.Millisecond), last+1)
}

// startTime is process_start_time_seconds on url, or 0 while unreachable
// (during an exec the port queues connections and a scrape may time out).
func startTime(url string) float64 {
	fams, _, err := scrapeRaw(url)
	if err != nil {
		return 0
	}
	return fams.value("process_start_time_seconds")
}

// waitNewImage waits until the process behind metricsURL reports a start
// time other than before: the re-executed image is serving.
func waitNewImage(t *testing.T, p *proc, metricsURL string, before float64, bound time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		if p.exited() {
			t.Fatalf("%s exited during a restart: %v", p.name, p.waitErr)
		}
		if st := startTime(metricsURL); st != 0 && st != before {
			return time.Since(start)
		}
		if time.Since(start) > bound {
			t.Fatalf("%s: no new image serving %s within %v of the restart", p.name, metricsURL, bound)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSelfRestartSIGHUP: five SIGHUPs under continuous load. No dial may
// fail, and the PID, executable, socket inode, descriptor count and
// goroutine count must come back as they were.
func TestSelfRestartSIGHUP(t *testing.T) {
	// A private copy: the shared binary may be rebuilt while this runs.
	bin := copyExecutable(t, t.TempDir())
	s := startServerBin(t, bin, frontendUDS, "--restart-grace=2s", "--enable-profiling", "--agent-wait=10s")
	s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=500ms")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialer(t)
	checkReachable(t, d, backend, "b1", 3)
	pid := s.proc.cmd.Process.Pid
	ino := inode(t, s.sock)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)

	fd0, err := fdCount(pid)
	if err != nil {
		t.Fatal(err)
	}
	gc0, err := goroutines(s.adminPort)
	if err != nil {
		t.Fatal(err)
	}
	g0 := gc0.ours()
	t.Logf("baseline: pid %d, socket inode %d, %d fds, %d goroutines", pid, ino, fd0, g0)

	const workers, hups = 4, 5
	load := startRestartLoad(t, d, backend, "b1", workers)
	time.Sleep(time.Second) // load before the first signal
	var sent []time.Time
	var took []string
	for i := range hups {
		before := startTime(metricsURL)
		at := time.Now()
		sent = append(sent, at)
		s.proc.signal(t, syscall.SIGHUP)
		el := waitNewImage(t, s.proc, metricsURL, before, 20*time.Second)
		took = append(took, el.Round(time.Millisecond).String())
		checkSameProcess(t, s.proc, pid, bin)
		if got := inode(t, s.sock); got != ino {
			t.Fatalf("after SIGHUP #%d the socket inode is %d, was %d", i+1, got, ino)
		}
		// Spaced about a second apart, and never before the new image
		// serves (a SIGHUP during exec is another test's business).
		time.Sleep(time.Until(at.Add(time.Second)))
	}
	s.waitAgents(t, 1, 10*time.Second)
	time.Sleep(time.Second) // load after the last restart
	load.finish(t, fmt.Sprintf("%d workers dialling through %d SIGHUPs", workers, hups), sent)
	t.Logf("SIGHUP → new image serving /metrics: %s", strings.Join(took, ", "))
	if n := strings.Count(s.proc.out.String(), "re-executing in place"); n != hups {
		t.Errorf("log has %d \"re-executing in place\" lines, want %d", n, hups)
	}
	checkSameProcess(t, s.proc, pid, bin)

	// Resources settle back: nothing leaks per restart.
	var fd1, g1 int
	deadline := time.Now().Add(10 * time.Second)
	for {
		fd1, _ = fdCount(pid)
		gc1, _ := goroutines(s.adminPort)
		g1 = gc1.ours()
		if fd1 <= fd0+2 && g1 <= g0+5 && gc1.total > 0 && gc1.conns <= maxPooledConns {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("after %d restarts: %d fds (baseline %d), %d goroutines (baseline %d); fds: %s",
				hups, fd1, fd0, g1, g0, fdList(pid))
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("after %d restarts: %d fds (baseline %d), %d goroutines (baseline %d)", hups, fd1, fd0, g1, g0)
	checkReachable(t, d, backend, "b1", 3)
}

// copyExecutable copies the binary under test to dir, so a test can
// replace it without touching the shared one.
func copyExecutable(t *testing.T, dir string) string {
	t.Helper()
	dst := filepath.Join(dir, "konnectivity")
	in, err := os.Open(konnectivityBin)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	return dst
}

// buildVersion builds the main module into path with main.version set.
func buildVersion(t *testing.T, path, version string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath",
		"-ldflags", "-X main.version="+version, "-o", path, ".")
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build -ldflags \"-X main.version=%s\" in ..: %v\n%s", version, err, out)
	}
	t.Logf("built %s (version %s) in %v", path, version, time.Since(start).Round(time.Millisecond))
}

// buildInfoVersion is the version label of *_build_info in a scrape.
func buildInfoVersion(fams metricFamilies, family string) string {
	m := fams.series(family, nil)
	if m == nil {
		return ""
	}
	for _, lp := range m.GetLabel() {
		if lp.GetName() == "version" {
			return lp.GetValue()
		}
	}
	return ""
}

// TestRestartOnBinaryChange: replacing the executable on disk (atomic
// rename, as a package manager does) makes the running server re-execute
// into the new build, same PID.
func TestRestartOnBinaryChange(t *testing.T) {
	dir := t.TempDir()
	bin := copyExecutable(t, dir)
	newBin := filepath.Join(dir, ".konnectivity.new")
	buildVersion(t, newBin, "e2e-new")
	out, err := exec.Command(newBin, "version").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), "konnectivity e2e-new") {
		t.Fatalf("%s version: %q, %v", newBin, out, err)
	}

	s := startServerBin(t, bin, frontendUDS, "--restart-on-binary-change",
		"--restart-check-interval=200ms", "--restart-grace=1s", "--agent-wait=10s")
	s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=500ms")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialer(t)
	checkReachable(t, d, backend, "b1", 3)
	pid := s.proc.cmd.Process.Pid
	ino := inode(t, s.sock)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
	const family = "konnectivity_network_proxy_server_build_info"
	old := buildInfoVersion(scrape(t, metricsURL), family)
	t.Logf("running: %s{version=%q}", family, old)
	if old == "" || strings.HasPrefix(old, "konnectivity e2e-new") {
		t.Fatalf("unexpected version before the swap: %q", old)
	}

	if err := os.Rename(newBin, bin); err != nil {
		t.Fatal(err)
	}
	swapped := time.Now()
	var now string
	waitFor(t, 20*time.Second, "build_info reports the new version", func() bool {
		if s.proc.exited() {
			t.Fatalf("server exited after the swap: %v", s.proc.waitErr)
		}
		fams, _, err := scrapeRaw(metricsURL)
		if err != nil {
			return false
		}
		now = buildInfoVersion(fams, family)
		return strings.HasPrefix(now, "konnectivity e2e-new")
	})
	t.Logf("%s{version=%q} %v after the rename", family, now, time.Since(swapped).Round(time.Millisecond))
	checkSameProcess(t, s.proc, pid, bin)
	if got := inode(t, s.sock); got != ino {
		t.Errorf("socket inode %d after the restart, was %d", got, ino)
	}
	if !strings.Contains(s.proc.out.String(), "executable replaced") {
		t.Errorf("no \"executable replaced\" log line")
	}
	s.waitAgents(t, 1, 10*time.Second)
	checkReachable(t, d, backend, "b1", 5)
}

// TestRestartRefused: a restart into a file that cannot run is refused
// before anything stops; an executable that fails after exec ends the
// process with its status (the supervisor's respawn takes over).
func TestRestartRefused(t *testing.T) {
	dir := t.TempDir()
	bin := copyExecutable(t, dir)
	s := startServerBin(t, bin, frontendUDS, "--restart-grace=1s")
	s.startAgent(t, "a1", "")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialer(t)
	checkReachable(t, d, backend, "b1", 3)
	pid := s.proc.cmd.Process.Pid
	refusals := func() int { return strings.Count(s.proc.out.String(), "restart refused") }

	t.Run("not-executable", func(t *testing.T) {
		if err := os.Chmod(bin, 0o644); err != nil {
			t.Fatal(err)
		}
		s.proc.signal(t, syscall.SIGHUP)
		waitFor(t, 10*time.Second, "\"restart refused\" logged", func() bool { return refusals() == 1 })
		t.Logf("%s", lineWith(s.proc.out.String(), "restart refused"))
		checkSameProcess(t, s.proc, pid, bin)
		checkReachable(t, d, backend, "b1", 5)
		if err := os.Chmod(bin, 0o755); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("missing", func(t *testing.T) {
		if err := os.Remove(bin); err != nil {
			t.Fatal(err)
		}
		s.proc.signal(t, syscall.SIGHUP)
		waitFor(t, 10*time.Second, "second \"restart refused\" logged", func() bool { return refusals() == 2 })
		if s.proc.exited() || s.proc.cmd.Process.Pid != pid {
			t.Fatalf("server gone after a refused restart: %v", s.proc.waitErr)
		}
		checkReachable(t, d, backend, "b1", 5)
	})

	t.Run("exec-fails", func(t *testing.T) {
		tmp := bin + ".tmp"
		if err := os.WriteFile(tmp, []byte("#!/bin/sh\n[ \"$1\" = check ] && exit 0 # passes the configuration check, fails to start\necho broken >&2\nexit 3\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, bin); err != nil {
			t.Fatal(err)
		}
		s.proc.signal(t, syscall.SIGHUP)
		select {
		case <-s.proc.done:
		case <-time.After(15 * time.Second):
			t.Fatalf("server still running 15 s after SIGHUP into a failing executable")
		}
		var ee *exec.ExitError
		if !asExitError(s.proc.waitErr, &ee) || ee.ExitCode() != 3 {
			t.Errorf("exit after exec into a failing script: %v, want exit status 3", s.proc.waitErr)
		}
		out := s.proc.out.String()
		if !strings.Contains(out, "re-executing in place") {
			t.Errorf("no \"re-executing in place\" log line")
		}
		if !strings.Contains(out, "broken") {
			t.Errorf("the replacement script's output is missing: it did not run in this process")
		}
		t.Logf("server PID %d ended: %v; %s", pid, s.proc.waitErr, lineWith(out, "re-executing in place"))
	})
}

func asExitError(err error, target **exec.ExitError) bool {
	ee, ok := err.(*exec.ExitError)
	if ok {
		*target = ee
	}
	return ok
}

// TestAgentSelfRestart: SIGHUP on an agent re-executes it in place after
// draining; with a second agent up, no dial fails meanwhile, and the
// restarted agent (same PID) serves dials again.
func TestAgentSelfRestart(t *testing.T) {
	s := startServer(t, "--agent-wait=10s")
	agentFlags := []string{"--drain-timeout=2s", "--sync-interval=100ms", "--sync-interval-cap=500ms"}
	// a1 runs from a private copy: the shared binary may be rebuilt meanwhile.
	bin := copyExecutable(t, t.TempDir())
	a1 := s.launchAgentFrom(t, bin, nil, s.pki, "a1", "", agentFlags...)
	waitHTTP(t, a1.proc, a1.healthURL("/readyz"), 200)
	a2 := s.startAgent(t, "a2", "", agentFlags...)
	s.waitAgents(t, 2, startTimeout)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialer(t)
	checkReachable(t, d, backend, "b1", 3)
	pid := a1.proc.cmd.Process.Pid
	metricsURL := a1.healthURL("/metrics")
	before := startTime(metricsURL)

	load := startRestartLoad(t, d, backend, "b1", 2)
	time.Sleep(500 * time.Millisecond)
	at := time.Now()
	a1.proc.signal(t, syscall.SIGHUP)
	el := waitNewImage(t, a1.proc, metricsURL, before, 20*time.Second)
	waitHTTP(t, a1.proc, a1.healthURL("/readyz"), 200)
	s.waitAgents(t, 2, 10*time.Second)
	back := time.Since(at)
	time.Sleep(500 * time.Millisecond)
	load.finish(t, "2 workers dialling while agent a1 restarts", []time.Time{at})
	t.Logf("agent SIGHUP → new image serving after %v, reconnected after %v", el.Round(time.Millisecond), back.Round(time.Millisecond))
	checkSameProcess(t, a1.proc, pid, bin)
	if !strings.Contains(a1.proc.out.String(), "re-executing in place") {
		t.Errorf("agent log has no \"re-executing in place\" line")
	}

	// Only the restarted agent left: every dial goes through it.
	a2.proc.stop(t)
	s.waitAgents(t, 1, 10*time.Second)
	checkReachable(t, d, backend, "b1", 10)
}

// TestRestartDrainWindow covers what happens between the SIGHUP and the
// exec, while an open tunnel keeps the server draining: the listeners
// have already been duplicated for the new image, and the old image still
// serves its health and admin ports.
func TestRestartDrainWindow(t *testing.T) {
	// The restart must complete even when someone (a liveness probe,
	// Prometheus) talks to the health port during the drain.
	t.Run("health-probed-during-drain", func(t *testing.T) {
		s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS, "--restart-grace=3s")
		s.startAgent(t, "a1", "", "--sync-interval=100ms")
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		// Probe the health port during the drain, then watch for the new
		// image on the admin port only: a health listener whose accept
		// is stuck would be released by any further probe.
		adminMetrics := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
		before := startTime(adminMetrics)
		c := openEcho(t, s, echo)
		s.proc.signal(t, syscall.SIGHUP)
		waitFor(t, 5*time.Second, "restart begins", func() bool {
			return strings.Contains(s.proc.out.String(), "restarting in place")
		})
		// One connection per probe, as kubelet and supervise-daemon do.
		for range 3 {
			if _, _, err := scrapeRaw(s.healthURL("/metrics")); err != nil {
				t.Errorf("health /metrics during the drain: %v", err)
			}
			time.Sleep(20 * time.Millisecond)
		}
		c.Close()
		waitNewImageOrDump(t, s, adminMetrics, before)
	})

	// The duplicated descriptors must survive a garbage collection in the
	// old image (GOGC=1 makes one all but certain during the drain); a
	// closed one makes the new image open a new socket: new inode, and
	// whatever waited in the old backlog is refused.
	t.Run("gc-during-drain", func(t *testing.T) {
		s := startServerBinEnv(t, copyExecutable(t, t.TempDir()), []string{"GOGC=1"}, frontendUDS, "--restart-grace=3s")
		s.startAgent(t, "a1", "", "--sync-interval=100ms")
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		metricsURL := s.healthURL("/metrics")
		ino := inode(t, s.sock)
		for i := range 3 {
			before := startTime(metricsURL)
			c := openEcho(t, s, echo)
			br := bufio.NewReader(c)
			s.proc.signal(t, syscall.SIGHUP)
			for end := time.Now().Add(time.Second); time.Now().Before(end); {
				if err := echoOnce(c, br, "during the drain\n"); err != nil {
					t.Fatalf("restart %d: open tunnel during the drain: %v", i+1, err)
				}
			}
			c.Close()
			waitNewImageOrDump(t, s, metricsURL, before)
			s.waitAgents(t, 1, 10*time.Second)
			if line := lineWith(s.proc.out.String(), "inherited listener unusable"); line != "" {
				t.Fatalf("restart %d: %s", i+1, line)
			}
			if got := inode(t, s.sock); got != ino {
				t.Fatalf("restart %d: socket inode %d, was %d", i+1, got, ino)
			}
		}
	})
}

// openEcho opens a tunnel to echo through s and checks one round trip.
func openEcho(t *testing.T, s *server, echo *tcpBackend) net.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := s.egressDialer(t).bounded()(ctx, "tcp", echo.addr())
	if err != nil {
		t.Fatalf("dial echo: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	if err := echoOnce(c, bufio.NewReader(c), "before\n"); err != nil {
		t.Fatal(err)
	}
	return c
}

// waitNewImageOrDump waits up to 10 s for the re-executed image; if it
// never comes, it asks the stuck process for its goroutines (SIGQUIT) and
// fails with the main goroutine's stack.
func waitNewImageOrDump(t *testing.T, s *server, metricsURL string, before float64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if s.proc.exited() {
			t.Fatalf("server exited during the restart: %v", s.proc.waitErr)
		}
		if st := startTime(metricsURL); st != 0 && st != before {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	out := s.proc.out.String()
	_ = s.proc.cmd.Process.Signal(syscall.SIGQUIT)
	select {
	case <-s.proc.done:
	case <-time.After(5 * time.Second):
	}
	dump := s.proc.out.String()[len(out):]
	if i := strings.Index(dump, "goroutine 1 "); i >= 0 {
		dump = dump[i:]
		if j := strings.Index(dump, "\n\n"); j >= 0 {
			dump = dump[:j]
		}
	}
	t.Fatalf("no new image 10 s after the tunnel closed (last log: %q); main goroutine:\n%s",
		lastLine(out), dump)
}

func lastLine(s string) string {
	s = strings.TrimRight(s, "\n")
	return s[strings.LastIndex(s, "\n")+1:]
}

// TestRestartKeepsKeepAliveConnections: clients that keep one connection
// each through the tunnel and send POSTs on it back to back (what
// kube-apiserver does with webhooks) lose no call across three SIGHUP
// restarts, and never dial again: each tunnel is paused, handed to the
// next image and resumed (docs/restart.md, "The handover").
// Both front doors, each through kube-apiserver's own egress dialer.
func TestRestartKeepsKeepAliveConnections(t *testing.T) {
	t.Run("http-connect", func(t *testing.T) { keepAliveAcrossRestarts(t, apiserverapi.ProtocolHTTPConnect) })
	t.Run("grpc", func(t *testing.T) { keepAliveAcrossRestarts(t, apiserverapi.ProtocolGRPC) })
}

func keepAliveAcrossRestarts(t *testing.T, proto apiserverapi.ProtocolType) {
	bin := copyExecutable(t, t.TempDir())
	mode := "--mode=http-connect"
	if proto == apiserverapi.ProtocolGRPC {
		mode = "--mode=grpc"
	}
	s := startServerBin(t, bin, frontendUDS, mode, "--restart-grace=5s", "--enable-profiling", "--agent-wait=10s")
	s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=500ms")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialerProto(t, proto)
	checkReachable(t, d, backend, "b1", 3)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
	pid := s.proc.cmd.Process.Pid

	const workers, hups = 4, 3
	p := startPostWorkers(t, d, backend, workers)
	time.Sleep(time.Second)
	for i := range hups {
		before := startTime(metricsURL)
		s.proc.signal(t, syscall.SIGHUP)
		waitNewImage(t, s.proc, metricsURL, before, 20*time.Second)
		s.waitAgents(t, 1, 10*time.Second)
		checkSameProcess(t, s.proc, pid, bin)
		t.Logf("SIGHUP #%d done at %s", i+1, time.Now().Format("15:04:05.000"))
		time.Sleep(time.Second)
	}
	p.halt()
	t.Logf("%d keep-alive POSTs across %d SIGHUP restarts, %d failed", p.ok.Load(), hups, p.failed.Load())
	if p.failed.Load() > 0 || p.ok.Load() < 100 {
		t.Errorf("%d ok, %d failed:\n%s", p.ok.Load(), p.failed.Load(), p.errors())
	}
	p.checkConns(t, "the restarts")
	out := s.proc.out.String()
	if n := strings.Count(out, "paused tunnels handed to the next image"); n != hups {
		t.Errorf("log has %d handovers, want %d", n, hups)
	}
	if strings.Contains(out, "could not be resumed") || strings.Contains(out, "could not be paused") {
		t.Errorf("a tunnel was lost in a handover:\n%s", out)
	}
}

// postWorkers are HTTP clients through the tunnel, one connection each
// kept alive, that POST to a backend's /echo back to back and check each
// echo, as kube-apiserver calls webhooks. halt owns the workers'
// goroutines: a test calls it before it reads its verdict, and a cleanup
// calls it for a test that ends early.
type postWorkers struct {
	ok, failed atomic.Int64
	mu         sync.Mutex
	errs       []string  // guarded by mu: one line per failed call
	conns      []connLog // conns[w] records how worker w's connections ended
	stop       chan struct{}
	halted     sync.Once // closes stop once
	wg         sync.WaitGroup
}

// startPostWorkers starts n workers dialling through d to backend.
func startPostWorkers(t *testing.T, d dialFunc, backend string, n int) *postWorkers {
	p := &postWorkers{conns: make([]connLog, n), stop: make(chan struct{})}
	t.Cleanup(p.halt)
	for w := range n {
		client := d.loggedHTTPClient(&p.conns[w])
		p.wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-p.stop:
					return
				default:
				}
				want := fmt.Sprintf("worker %d call %d %s", w, i, strings.Repeat("x", i%400)) // under 512 bytes: the backend echoes as it reads
				resp, err := client.Post(fmt.Sprintf("http://%s/echo", backend), "text/plain", strings.NewReader(want))
				var got []byte
				if err == nil {
					got, err = io.ReadAll(resp.Body)
					resp.Body.Close()
				}
				if err == nil && string(got) != want {
					err = fmt.Errorf("echo of %d bytes came back as %d bytes", len(want), len(got))
				}
				if err == nil {
					p.ok.Add(1)
					continue
				}
				p.failed.Add(1)
				p.mu.Lock()
				p.errs = append(p.errs, fmt.Sprintf("worker %d call %d at %s: %v", w, i, time.Now().Format("15:04:05.000"), err))
				p.mu.Unlock()
			}
		})
	}
	return p
}

// halt stops the workers and waits for them to return.
func (p *postWorkers) halt() {
	p.halted.Do(func() { close(p.stop) })
	p.wg.Wait()
}

// errors is every failed call, one a line.
func (p *postWorkers) errors() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Join(p.errs, "\n")
}

// checkConns fails the test if any worker's connection was ended by the
// server side: a keep-alive connection must live through what restarts
// names. A worker that dialled again because its own HTTP client dropped
// the connection is only logged.
func (p *postWorkers) checkConns(t *testing.T, restarts string) {
	t.Helper()
	for w := range p.conns {
		dials, byServer, ends := p.conns[w].summary()
		if byServer > 0 {
			t.Errorf("worker %d: %d of its %d connections ended by the server side, want none: a keep-alive connection did not live through %s (%s)", w, byServer, dials, restarts, ends)
		} else if dials != 1 {
			t.Logf("worker %d dialled %d times, every earlier connection dropped by its own HTTP client (%s)", w, dials, ends)
		}
	}
}

// connLog records how the connections one HTTP client dialled ended, so
// that a connection the server ended (which a handover must never do to a
// keep-alive connection) is told apart from one the client dropped
// itself: Go's transport does not reuse a connection whose request write
// it has not seen finish within 50 ms of the response, and on a busy
// machine its writing goroutine can be that late.
type connLog struct {
	mu       sync.Mutex
	dials    int
	byServer int
	ends     []string
}

func (l *connLog) summary() (dials, byServer int, ends string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dials, l.byServer, strings.Join(l.ends, "; ")
}

func (l *connLog) ended(byServer bool, how string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if byServer {
		l.byServer++
	}
	l.ends = append(l.ends, fmt.Sprintf("connection %d %s at %s", len(l.ends)+1, how, time.Now().Format("15:04:05.000")))
}

// loggedConn reports to its connLog how it ended: a read that fails
// before the client closed it was ended by the other side.
type loggedConn struct {
	net.Conn
	log        *connLog
	once       sync.Once
	closedHere atomic.Bool
}

func (c *loggedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil && !c.closedHere.Load() {
		c.once.Do(func() { c.log.ended(true, fmt.Sprintf("ended by the server side (read: %v)", err)) })
	}
	return n, err
}

func (c *loggedConn) Close() error {
	c.closedHere.Store(true) // before the close, so a read it fails is not counted as the server's
	c.once.Do(func() { c.log.ended(false, "closed by the client") })
	return c.Conn.Close()
}

// loggedHTTPClient is httpClient with keep-alive whose connections report
// to l.
func (d dialFunc) loggedHTTPClient(l *connLog) *http.Client {
	bd := d.bounded()
	tr := &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := bd(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			l.mu.Lock()
			l.dials++
			l.mu.Unlock()
			return &loggedConn{Conn: c, log: l}, nil
		},
		MaxIdleConnsPerHost: 64,
	}
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}
