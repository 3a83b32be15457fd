package e2e

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// copyFile copies src to a new file in dir and returns its path.
func copyFile(t *testing.T, src, dir string) string {
	t.Helper()
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, filepath.Base(src))
	if err := os.WriteFile(dst, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return dst
}

// refusedRestart sends p SIGHUP with a file made garbage and checks that
// the restart is refused, naming the file, counted, and that the same
// image (same start time) keeps serving.
func refusedRestart(t *testing.T, p *proc, metricsURL, file, family string, refusals int) {
	t.Helper()
	before := startTime(metricsURL)
	p.signal(t, syscall.SIGHUP)
	waitFor(t, 15*time.Second, "\"restart refused\" logged", func() bool {
		return p.exited() || strings.Count(p.out.String(), "restart refused") >= refusals
	})
	if p.exited() {
		t.Fatalf("%s exited after a SIGHUP with a garbage file: %v", p.name, p.waitErr)
	}
	line := lineWith(p.out.String(), "restart refused")
	t.Logf("%s", line)
	if !strings.Contains(line, file) {
		t.Errorf("the refusal does not name %s: %s", file, line)
	}
	if now := startTime(metricsURL); now != before {
		t.Errorf("process start time %v, was %v: the process re-executed", now, before)
	}
	fams, _, err := scrapeRaw(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	if got := fams.value(family, "reason", "config"); got != float64(refusals) {
		t.Errorf("%s{reason=config} = %v, want %d", family, got, refusals)
	}
}

// TestRestartChecksConfigFirst: a SIGHUP while a file the next image would
// read is garbage (a reload in the middle of a CA rotation) is refused
// before anything stops, with a log line naming the file and a metric;
// the running image keeps serving and keeps its tunnels. Once the file is
// fixed, the next SIGHUP restarts and hands the tunnels over.
func TestRestartChecksConfigFirst(t *testing.T) {
	t.Run("server-ca", func(t *testing.T) {
		dir := t.TempDir()
		s := startServerBin(t, copyExecutable(t, dir), frontendUDS, "--restart-grace=5s")
		ca := copyFile(t, s.pki.caCert, dir)
		s.proc.stop(t)
		s.args = append(s.args, "--cluster-ca-cert="+ca)
		s.launch(t)
		s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=200ms")
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		var conns []net.Conn
		for range 20 {
			conns = append(conns, openEcho(t, s, echo))
		}
		good, err := os.ReadFile(ca)
		if err != nil {
			t.Fatal(err)
		}
		writeFileAtomic(t, ca, []byte("-----BEGIN CERTIFICATE-----\ngarbage\n"))
		metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
		refusedRestart(t, s.proc, metricsURL, ca, "konnectivity_network_proxy_server_restarts_refused_total", 1)
		checkTunnelsKept(t, conns, "refused restart")
		writeFileAtomic(t, ca, good)
		restartOnce(t, s)
		checkTunnelsKept(t, conns, "restart once the CA was fixed")
	})
	t.Run("agent-ca", func(t *testing.T) {
		dir := t.TempDir()
		s := startServerBin(t, copyExecutable(t, dir), frontendUDS)
		ca := copyFile(t, s.pki.caCert, dir)
		a := s.launchAgentFrom(t, copyExecutable(t, t.TempDir()), nil, s.pki, "a1", "", "--ca-cert="+ca,
			"--sync-interval=100ms", "--sync-interval-cap=200ms")
		waitHTTP(t, a.proc, a.healthURL("/readyz"), 200)
		waitHTTP(t, s.proc, s.healthURL("/readyz"), 200)
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		var conns []net.Conn
		for range 20 {
			conns = append(conns, openEcho(t, s, echo))
		}
		writeFileAtomic(t, ca, []byte("not a certificate\n"))
		metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", a.adminPort)
		refusedRestart(t, a.proc, metricsURL, ca, "konnectivity_network_proxy_agent_restarts_refused_total", 1)
		checkTunnelsKept(t, conns, "refused agent restart")
	})
}

// TestRestartNearDescriptorLimit: a server whose descriptor limit is 512
// hands over 300 open tunnels, more than half the limit: each socket
// crosses the exec as the descriptor already held, none needs a second.
func TestRestartNearDescriptorLimit(t *testing.T) {
	s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS, "--restart-grace=10s")
	lim := unix.Rlimit{Cur: 512, Max: 512}
	if err := unix.Prlimit(s.proc.cmd.Process.Pid, unix.RLIMIT_NOFILE, &lim, nil); err != nil {
		t.Fatalf("prlimit: %v", err)
	}
	s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=200ms")
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	var conns []net.Conn
	for range 300 {
		conns = append(conns, openEcho(t, s, echo))
	}
	took := restartOnce(t, s)
	t.Logf("restart with 300 tunnels at a descriptor limit of 512 took %v", took.Round(time.Millisecond))
	checkTunnelsKept(t, conns, "300 tunnels at a limit of 512")
	if out := s.proc.out.String(); strings.Contains(out, "not handed to the next image") {
		t.Errorf("sockets lost: %s", lineWith(out, "not handed to the next image"))
	}
}

// TestRestartDuringTokenReviewOutage: a SIGHUP while the TokenReview API
// resets every connection: the reviews the running image accepted cross
// the exec, so the next image re-admits its token agents without a
// TokenReview and every tunnel they held is resumed.
func TestRestartDuringTokenReviewOutage(t *testing.T) {
	p := newPKI(t, t.TempDir())
	api := startFakeAPIServer(t, p)
	dir := t.TempDir()
	s := startTokenServer(t, p, api, dir, "--restart-grace=5s")
	token := filepath.Join(dir, "token")
	writeFileAtomic(t, token, []byte(goodToken))
	startTokenAgent(t, s, p, "a1", token)
	startTokenAgent(t, s, p, "a2", token)
	s.waitAgents(t, 2, startTimeout)
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	var conns []net.Conn
	for range 20 {
		conns = append(conns, openEcho(t, s, echo))
	}
	api.down.Store(true)
	reviews := api.reviews.Load()
	took := restartOnce(t, s)
	t.Logf("restart during the outage took %v; %s", took.Round(time.Millisecond), lineWith(s.proc.out.String(), "token reviews taken over"))
	s.waitAgents(t, 2, 10*time.Second)
	checkTunnelsKept(t, conns, "restart during a TokenReview outage")
	if n := api.reviews.Load() - reviews; n != 0 {
		t.Errorf("%d TokenReviews answered during the outage", n)
	}
}
