package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"
	apiserverapi "k8s.io/apiserver/pkg/apis/apiserver"
)

// Restarts under attack: what a peer does, or fails to do, while the
// server re-executes in place must not cost another client its tunnel
// (RELIABILITY.md, "Restarts under attack").

// slowLogin is a TCP relay between an agent and the server's agent port
// that, once armed, holds each new connection for delay before passing
// it on: an agent whose login after a restart is slow.
type slowLogin struct {
	l     net.Listener
	armed atomic.Bool
	delay time.Duration
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns []net.Conn // every socket it opened, closed on cleanup
}

func startSlowLogin(t *testing.T, to string, delay time.Duration) *slowLogin {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &slowLogin{l: l, delay: delay}
	p.wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			p.track(c)
			p.wg.Go(func() {
				if p.armed.Load() {
					time.Sleep(p.delay)
				}
				up, err := net.Dial("tcp", to)
				if err != nil {
					c.Close()
					return
				}
				p.track(up)
				go func() { _, _ = io.Copy(up, c); up.Close() }()
				_, _ = io.Copy(c, up)
				c.Close()
			})
		}
	})
	t.Cleanup(func() {
		l.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *slowLogin) track(c net.Conn) {
	p.mu.Lock()
	p.conns = append(p.conns, c)
	p.mu.Unlock()
}

func (p *slowLogin) port() int { return p.l.Addr().(*net.TCPAddr).Port }

// checkTunnelsKept fails t unless every tunnel still echoes: each was
// handed from image to image, never closed.
func checkTunnelsKept(t *testing.T, conns []net.Conn, what string) {
	t.Helper()
	lost := 0
	for i, c := range conns {
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		if err := echoOnce(c, bufio.NewReader(c), fmt.Sprintf("after %d\n", i)); err != nil {
			lost++
			t.Errorf("%s: tunnel %d lost: %v", what, i, err)
		}
	}
	t.Logf("%s: %d of %d tunnels kept", what, len(conns)-lost, len(conns))
}

// TestRestartDuringResumeKeepsTunnels: a SIGHUP that comes while the
// tunnels the previous image handed over still wait for their agent to log
// in again passes them on to the next image as they are: none is lost,
// whether the second SIGHUP comes 0.3 s after the first with the agent's
// login slowed to 1 s, or 50 come 10 ms apart.
func TestRestartDuringResumeKeepsTunnels(t *testing.T) {
	t.Run("second-sighup-during-slow-login", func(t *testing.T) {
		s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS, "--restart-grace=5s")
		relay := startSlowLogin(t, fmt.Sprintf("127.0.0.1:%d", s.agentPort), time.Second)
		realPort := s.agentPort
		s.agentPort = relay.port()
		s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=200ms")
		s.agentPort = realPort
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		var conns []net.Conn
		for range 5 {
			conns = append(conns, openEcho(t, s, echo))
		}
		relay.armed.Store(true)
		metricsURL := s.healthURL("/metrics")
		before := startTime(metricsURL)
		s.proc.signal(t, syscall.SIGHUP)
		waitNewImageOrDump(t, s, metricsURL, before)
		time.Sleep(300 * time.Millisecond) // the agent's login is still held by the relay
		before = startTime(metricsURL)
		s.proc.signal(t, syscall.SIGHUP)
		waitNewImageOrDump(t, s, metricsURL, before)
		relay.armed.Store(false)
		checkTunnelsKept(t, conns, "SIGHUP 0.3 s after SIGHUP")
		if line := lineWith(s.proc.out.String(), "could not be resumed"); line != "" {
			t.Errorf("a tunnel was not resumed: %s", line)
		}
	})
	t.Run("50-sighups-10ms-apart", func(t *testing.T) {
		s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS, "--restart-grace=5s")
		s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=200ms")
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		var conns []net.Conn
		for range 5 {
			conns = append(conns, openEcho(t, s, echo))
		}
		for range 50 {
			s.proc.signal(t, syscall.SIGHUP)
			time.Sleep(10 * time.Millisecond)
		}
		checkTunnelsKept(t, conns, "50 SIGHUPs 10 ms apart")
		if s.proc.exited() {
			t.Fatalf("server exited: %v", s.proc.waitErr)
		}
		if n := strings.Count(s.proc.out.String(), "could not be resumed"); n > 0 {
			t.Errorf("%d tunnels not resumed: %s", n, lineWith(s.proc.out.String(), "could not be resumed"))
		}
	})
}

// dialThrough opens a tunnel to addr through s without a round trip.
func dialThrough(t *testing.T, s *server, addr string) net.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := s.egressDialer(t).bounded()(ctx, "tcp", addr)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// restartOnce sends SIGHUP and waits for the next image; it returns how
// long the restart took, from the signal to the next image serving.
func restartOnce(t *testing.T, s *server) time.Duration {
	t.Helper()
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
	before := startTime(metricsURL)
	start := time.Now()
	s.proc.signal(t, syscall.SIGHUP)
	for {
		if s.proc.exited() {
			t.Fatalf("server exited during the restart: %v", s.proc.waitErr)
		}
		if st := startTime(metricsURL); st != 0 && st != before {
			return time.Since(start)
		}
		if time.Since(start) > 30*time.Second {
			t.Fatalf("no new image 30 s after SIGHUP (last log: %q)", lastLine(s.proc.out.String()))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRestartPausesEachTunnelAlone: a tunnel's chance to be handed over
// does not depend on its place in a queue or on another agent. 100
// tunnels whose client does not read beside 10 healthy ones on one agent,
// and an agent that never answers (stopped) holding 200 tunnels beside a
// good agent with 10: every healthy tunnel is handed over.
func TestRestartPausesEachTunnelAlone(t *testing.T) {
	t.Run("stalled-readers", func(t *testing.T) {
		s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS, "--restart-grace=10s")
		s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=200ms")
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		var written atomic.Int64
		hose := startTCPBackend(t, "127.0.0.1", firehoseHandler(&written))
		var healthy []net.Conn
		for i := range 110 {
			if i%11 == 5 {
				healthy = append(healthy, openEcho(t, s, echo))
				continue
			}
			c := dialThrough(t, s, hose.addr())
			if _, err := c.Write([]byte{'g'}); err != nil { // go: the client then never reads
				t.Fatal(err)
			}
		}
		took := restartOnce(t, s)
		t.Logf("restart with 100 stalled tunnels took %v", took.Round(time.Millisecond))
		checkTunnelsKept(t, healthy, "healthy beside 100 stalled")
	})
	t.Run("agent-never-answers", func(t *testing.T) {
		s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS, "--restart-grace=10s",
			"--proxy-strategies=destHost,default")
		bad := s.startAgent(t, "bad", "ipv4=127.0.0.2", "--sync-interval=100ms", "--sync-interval-cap=200ms")
		s.startAgent(t, "good", "ipv4=127.0.0.3", "--sync-interval=100ms", "--sync-interval-cap=200ms")
		echoBad := startTCPBackend(t, "127.0.0.2", echoHandler)
		echoGood := startTCPBackend(t, "127.0.0.3", echoHandler)
		var good []net.Conn
		for i := range 210 {
			if i%21 == 10 {
				good = append(good, openEcho(t, s, echoGood))
				continue
			}
			openEcho(t, s, echoBad)
		}
		bad.proc.freeze(t)
		took := restartOnce(t, s)
		t.Logf("restart with an agent that never answers took %v", took.Round(time.Millisecond))
		checkTunnelsKept(t, good, "good agent's beside a stopped agent with 200")
	})
}

// idleGRPCPeer opens a gRPC front door connection that sends the HTTP/2
// preface and its SETTINGS, answers PINGs and SETTINGS, and opens no
// stream; goAway is closed when the server sends GOAWAY.
func idleGRPCPeer(t *testing.T, sock string) (goAway chan struct{}) {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fr := http2.NewFramer(c, c)
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	goAway = make(chan struct{})
	var once sync.Once
	go func() {
		defer once.Do(func() { close(goAway) })
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.PingFrame:
				if !f.IsAck() {
					_ = fr.WritePing(true, f.Data)
				}
			case *http2.SettingsFrame:
				if !f.IsAck() {
					_ = fr.WriteSettingsAck()
				}
			case *http2.GoAwayFrame:
				return
			}
		}
	}()
	return goAway
}

// TestRestartNotDelayedByIdlePeers: nothing a peer has not asked for
// delays a restart. One idle gRPC connection (preface, no stream); a silent TCP
// peer on the mTLS front door and a Unix-socket peer with half a CONNECT
// head: every tunnel is handed over, the restart takes about what it
// takes without them, the idle gRPC connection gets GOAWAY, and the
// Unix-socket peer, handed to the next image as it is, finishes its head
// there and gets its tunnel.
func TestRestartNotDelayedByIdlePeers(t *testing.T) {
	t.Run("grpc-idle-connection", func(t *testing.T) {
		s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS, "--mode=grpc", "--restart-grace=10s")
		s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=200ms")
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		d := s.egressDialerProto(t, apiserverapi.ProtocolGRPC).bounded()
		var conns []net.Conn
		for range 5 {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			c, err := d(ctx, "tcp", echo.addr())
			cancel()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			if err := echoOnce(c, bufio.NewReader(c), "before\n"); err != nil {
				t.Fatal(err)
			}
			conns = append(conns, c)
		}
		baseline := restartOnce(t, s)
		goAway := idleGRPCPeer(t, s.sock)
		time.Sleep(100 * time.Millisecond) // the server has read its preface
		took := restartOnce(t, s)
		t.Logf("restart: %v without the idle connection, %v with it", baseline.Round(time.Millisecond), took.Round(time.Millisecond))
		checkTunnelsKept(t, conns, "beside an idle gRPC connection")
		select {
		case <-goAway:
		case <-time.After(10 * time.Second):
			t.Error("the idle gRPC connection was not let go")
		}
		if took > 2*baseline+time.Second {
			t.Errorf("restart took %v with an idle gRPC connection, %v without", took, baseline)
		}
	})
	t.Run("http-connect-silent-peers", func(t *testing.T) {
		tcpPort := freePort(t)
		s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS, "--restart-grace=10s")
		s.proc.stop(t)
		s.args = append(s.args,
			"--server-bind-address=127.0.0.1",
			fmt.Sprintf("--server-port=%d", tcpPort),
			"--server-cert="+s.pki.serverCert,
			"--server-key="+s.pki.serverKey,
			"--server-ca-cert="+s.pki.caCert)
		s.launch(t)
		s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=200ms")
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		var conns []net.Conn
		for range 5 {
			conns = append(conns, openEcho(t, s, echo))
		}
		baseline := restartOnce(t, s)
		silentTCP, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", tcpPort))
		if err != nil {
			t.Fatal(err)
		}
		defer silentTCP.Close()
		halfHead, err := net.Dial("unix", s.sock)
		if err != nil {
			t.Fatal(err)
		}
		defer halfHead.Close()
		if _, err := fmt.Fprintf(halfHead, "CONNECT %s HTTP/1.1\r\n", echo.addr()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond) // the server has read it
		took := restartOnce(t, s)
		t.Logf("restart: %v without the silent peers, %v with them", baseline.Round(time.Millisecond), took.Round(time.Millisecond))
		checkTunnelsKept(t, conns, "beside silent TCP and Unix-socket peers")
		if took > 2*baseline+time.Second {
			t.Errorf("restart took %v with silent peers, %v without", took, baseline)
		}
		// The rest of the head, to the next image.
		_ = halfHead.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(halfHead, "Host: 127.0.0.1\r\n\r\n"); err != nil {
			t.Fatalf("half a head across the restart: %v", err)
		}
		br := bufio.NewReader(halfHead)
		status, err := br.ReadString('\n')
		if err != nil || !strings.Contains(status, " 200 ") {
			t.Fatalf("half a head across the restart: %q %v", status, err)
		}
		for line := status; line != "\r\n"; {
			if line, err = br.ReadString('\n'); err != nil {
				t.Fatal(err)
			}
		}
		if err := echoOnce(halfHead, br, "after\n"); err != nil {
			t.Fatalf("tunnel asked for across the restart: %v", err)
		}
	})
}

// TestStalledTunnelMemoryBudget: what tunnels whose client does not read
// make the server hold, in all, is bounded by
// --stalled-tunnel-memory-budget: past it a new dial gets 503 saying so,
// counted in dial_failure_count{reason="stalled_budget"}; once the
// stalled clients leave, dials are served again and nothing stays held.
func TestStalledTunnelMemoryBudget(t *testing.T) {
	s := startServer(t, "--stalled-tunnel-memory-budget=4")
	s.startAgent(t, "a1", "")
	var written atomic.Int64
	hose := startTCPBackend(t, "127.0.0.1", firehoseHandler(&written))
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
	held := func() float64 {
		fams, _, err := scrapeRaw(metricsURL)
		if err != nil {
			t.Fatal(err)
		}
		return fams.value("konnectivity_network_proxy_server_stalled_tunnel_bytes")
	}
	// Stalled tunnels, each filling its window (1 MiB or more: windows
	// follow the link), until a dial is refused: not while less than the
	// 4 MiB budget is held, and soon after.
	var stalled []net.Conn
	defer func() {
		for _, c := range stalled {
			c.Close()
		}
	}()
	refusedAt := 0
	for i := range 20 {
		// Read before the dial: the new tunnel may fill its window
		// before a later reading, which would then never see it grow.
		before := held()
		c, _, code, msg, err := faultConnect(s.sock, hose.addr(), 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if code != http.StatusOK {
			if code != http.StatusServiceUnavailable || !strings.Contains(msg, "stalled tunnels") {
				t.Fatalf("dial %d: %d %q, want 503 naming the budget", i, code, msg)
			}
			refusedAt = i
			break
		}
		if _, err := c.Write([]byte{'g'}); err != nil { // go: the client then never reads
			t.Fatal(err)
		}
		stalled = append(stalled, c)
		waitFor(t, 30*time.Second, "the new tunnel holds bytes", func() bool { return held() > before })
		t.Logf("%d stalled: %.2f MiB held", len(stalled), held()/(1<<20))
	}
	h := held()
	t.Logf("dial %d refused: %.2f MiB held for %d stalled clients, budget 4 MiB", refusedAt+1, h/(1<<20), len(stalled))
	if refusedAt == 0 || h < 4<<20 || h > 6<<20 {
		t.Errorf("refused at dial %d with %.2f MiB held; want no refusal while less than 4 MiB are held, and at most 6 MiB", refusedAt+1, h/(1<<20))
	}
	fams, _, err := scrapeRaw(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	if n := fams.value("konnectivity_network_proxy_server_dial_failure_count", "reason", "stalled_budget"); n < 1 {
		t.Errorf("dial_failure_count{reason=stalled_budget} = %v, want at least 1", n)
	}
	for _, c := range stalled {
		c.Close()
	}
	stalled = nil
	waitFor(t, 30*time.Second, "nothing held once the stalled clients left", func() bool { return held() == 0 })
	openEcho(t, s, echo)
}
