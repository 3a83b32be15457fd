package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// logPipe is where a process's standard output and error go, as a
// supervisor's or a container runtime's pipe: blocking on the process's
// side, read by the test (collected in out) until it stops reading, then
// filled, read again, or closed.
type logPipe struct {
	w       *os.File      // the process's end
	r       *os.File      // the test's end, non-blocking so that a read can be stopped
	out     lockedBuffer  // what the test read
	reading chan struct{} // closed when the reader returns; nil while none runs
}

// newLogPipe makes a pipe and starts reading it.
func newLogPipe(t *testing.T) *logPipe {
	t.Helper()
	var fds [2]int
	if err := syscall.Pipe2(fds[:], syscall.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	if err := syscall.SetNonblock(fds[0], true); err != nil { // the test's end only
		t.Fatal(err)
	}
	p := &logPipe{r: os.NewFile(uintptr(fds[0]), "log pipe, read end"), w: os.NewFile(uintptr(fds[1]), "log pipe, write end")}
	t.Cleanup(func() {
		p.stop()
		p.r.Close()
		p.w.Close()
		if t.Failed() {
			out := p.out.String()
			t.Logf("--- what the test read from the log pipe (last 8 KiB of %d bytes):\n%s", len(out), out[max(0, len(out)-8192):])
		}
	})
	p.read()
	return p
}

// read reads the pipe until stop or close.
func (p *logPipe) read() {
	done := make(chan struct{})
	p.reading = done
	p.r.SetReadDeadline(time.Time{})
	go func() {
		defer close(done)
		io.Copy(&p.out, p.r)
	}()
}

// stop stops reading: what the process writes from now on stays in the
// pipe.
func (p *logPipe) stop() {
	if p.reading == nil {
		return
	}
	p.r.SetReadDeadline(time.Unix(1, 0))
	<-p.reading
	p.reading = nil
}

// fill stops reading and fills the pipe, so that no write to it can
// proceed: page-sized writes (which never merge into a page begun) until
// one finds no free page. It writes through a second, non-blocking open
// of the pipe, leaving the process's blocking one as it is.
func (p *logPipe) fill(t *testing.T) int {
	t.Helper()
	p.stop()
	fd, err := syscall.Open(fmt.Sprintf("/proc/self/fd/%d", p.w.Fd()), syscall.O_WRONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open the log pipe to fill it: %v", err)
	}
	defer syscall.Close(fd)
	page := []byte(strings.Repeat("#", 4095) + "\n")
	n := 0
	for {
		w, err := syscall.Write(fd, page)
		if errors.Is(err, syscall.EAGAIN) {
			return n
		}
		if err != nil {
			t.Fatalf("fill the log pipe: %v", err)
		}
		n += w
	}
}

// closeReader stops reading and closes the test's end: the process's next
// write to the pipe fails with EPIPE.
func (p *logPipe) closeReader() {
	p.stop()
	p.r.Close()
}

// TestLogPipeNobodyReads: a daemon whose standard output and error go to
// a pipe nobody reads (a hung supervisor or container-runtime logger),
// filled, goes on serving: logins are answered, a fresh agent is listed
// once and carries dials, SIGHUP restarts it in place, SIGTERM stops it in
// its grace; its log lines wait in a bounded queue, the rest are dropped
// and counted, and one line says how many once the pipe is read again.
// When the pipe's reader goes away, the next log line costs that line
// only (EPIPE; Go would end the process with SIGPIPE): the daemon and its
// tunnels stay. An agent whose pipe is full serves the dials of a server
// that restarted.
func TestLogPipeNobodyReads(t *testing.T) {
	for _, ip := range []string{"127.0.0.2", "127.0.0.3"} {
		l, err := net.Listen("tcp", ip+":0")
		if err != nil {
			t.Skipf("cannot listen on %s (needs all of 127/8 on loopback, as on Linux): %v", ip, err)
		}
		l.Close()
	}
	t.Run("server", testLogPipeServer)
	t.Run("server-sigterm", testLogPipeServerSIGTERM)
	t.Run("agent", testLogPipeAgent)
}

func testLogPipeServer(t *testing.T) {
	pipe := newLogPipe(t)
	s := newServerSpec(t, copyExecutable(t, t.TempDir()), nil, frontendUDS, "--proxy-strategies=destHost,default", "--v=4")
	s.stdio = pipe.w
	s.launch(t)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
	s.startAgent(t, "a1", "ipv4=127.0.0.2")
	echo1 := startTCPBackend(t, "127.0.0.2", echoHandler)
	echo2 := startTCPBackend(t, "127.0.0.3", echoHandler)
	held := openEcho(t, s, echo1)
	heldR := bufio.NewReader(held)
	filled := pipe.fill(t)
	t.Logf("the server's log pipe filled (%d bytes after what it had logged); nobody reads it", filled)

	// Logins are answered: refusals first (each a WARN line), then a
	// fresh agent.
	tlsConf := agentTLSConfig(t, s.pki)
	for i := range 5 {
		start := time.Now()
		code, err := refusedLogin(s, tlsConf, "refused-"+strconv.Itoa(i))
		if err != nil || code != http.StatusUnauthorized {
			t.Fatalf("login %d with a malformed credential: %d %v after %v; want 401 at once", i, code, err, time.Since(start).Round(time.Millisecond))
		}
	}
	a2 := s.startAgent(t, "a2", "ipv4=127.0.0.3")
	s.waitAgents(t, 2, 10*time.Second)
	if n := listed(t, s, "a2"); n != 1 {
		t.Fatalf("the fresh agent is listed %d times, want once", n)
	}
	dialEchoes(t, s, echo2, 5, "through the fresh agent, the log pipe full")

	// Enough log lines to fill the queue: one debug line per bad request.
	dropped := 0.0
	requests := 0
	for requests < 40000 && dropped == 0 {
		for range 1000 {
			if err := badConnect(s.sock); err != nil {
				t.Fatalf("bad CONNECT %d, the log pipe full: %v", requests, err)
			}
			requests++
		}
		dropped = metricValue(t, metricsURL, srvPrefix+"log_lines_dropped_total")
	}
	if dropped <= 0 {
		t.Fatalf("%d bad requests logged at debug, the log pipe full: log_lines_dropped_total %v, want some", requests, dropped)
	}
	t.Logf("%d bad requests, each logged at debug, the log pipe full: every one answered; %v lines dropped", requests, dropped)

	// SIGHUP: the next image serves, the tunnel is handed over, both
	// agents are back.
	before := startTime(metricsURL)
	s.proc.signal(t, syscall.SIGHUP)
	took := waitNewImage(t, s.proc, metricsURL, before, 15*time.Second)
	s.waitAgents(t, 2, 10*time.Second)
	held.SetDeadline(time.Now().Add(10 * time.Second))
	if err := echoOnce(held, heldR, "after the restart\n"); err != nil {
		t.Fatalf("the tunnel held across the restart, the log pipe full: %v", err)
	}
	dialEchoes(t, s, echo2, 3, "after the restart, the log pipe full")
	t.Logf("SIGHUP with the log pipe full: the next image served after %v, the tunnel kept", took.Round(time.Millisecond))

	// Read again: one line says how many were dropped, the previous
	// image's among them.
	pipe.read()
	re := regexp.MustCompile(`log lines dropped.* dropped=(\d+)`)
	var m []string
	waitFor(t, 10*time.Second, "the line saying how many log lines were dropped", func() bool {
		m = re.FindStringSubmatch(pipe.out.String())
		return m != nil
	})
	reported, _ := strconv.Atoi(m[1])
	if float64(reported) < dropped {
		t.Errorf("the next image reports %d log lines dropped; the previous one had dropped %v", reported, dropped)
	}
	t.Logf("the log pipe read again: %q", lineWith(pipe.out.String(), "log lines dropped"))

	// The reader goes away: the next lines fail with EPIPE, are counted,
	// and the server and its tunnels stay.
	pipe.closeReader()
	before = metricValue(t, metricsURL, srvPrefix+"log_lines_dropped_total")
	for i := range 20 {
		if err := badConnect(s.sock); err != nil {
			t.Fatalf("bad CONNECT %d after the log pipe's reader closed: %v", i, err)
		}
	}
	waitFor(t, 10*time.Second, "log lines dropped for the reader gone", func() bool {
		if s.proc.exited() {
			t.Fatalf("the server exited once its log pipe's reader closed: %v", s.proc.waitErr)
		}
		return metricValue(t, metricsURL, srvPrefix+"log_lines_dropped_total") >= before+20
	})
	gone := metricValue(t, metricsURL, srvPrefix+"log_lines_dropped_total") - before
	if err := echoOnce(held, heldR, "after the reader left\n"); err != nil {
		t.Fatalf("the tunnel held, after the log pipe's reader closed: %v", err)
	}
	dialEchoes(t, s, echo2, 3, "after the log pipe's reader closed")
	if got := getStatus(t, s.healthURL("/healthz")); got != http.StatusOK {
		t.Errorf("/healthz %d after the log pipe's reader closed", got)
	}
	a2.proc.stop(t)
	s.waitAgents(t, 1, 10*time.Second)
	s.proc.signal(t, syscall.SIGTERM)
	start := time.Now()
	select {
	case <-s.proc.done:
	case <-time.After(10 * time.Second):
		t.Fatalf("the server still runs 10 s after SIGTERM, its log pipe's reader gone")
	}
	if s.proc.waitErr != nil {
		t.Errorf("the server, its log pipe's reader gone, ended with %v after SIGTERM; want exit 0", s.proc.waitErr)
	}
	t.Logf("the log pipe's reader gone: %v lines dropped (EPIPE), the server alive, the tunnel and 3 dials served; SIGTERM: exit 0 after %v", gone, time.Since(start).Round(time.Millisecond))
}

// testLogPipeServerSIGTERM: SIGTERM stops a server whose log pipe is full
// within its grace, an open tunnel notwithstanding.
func testLogPipeServerSIGTERM(t *testing.T) {
	pipe := newLogPipe(t)
	s := newServerSpec(t, "", nil, frontendUDS)
	s.stdio = pipe.w
	s.launch(t)
	s.startAgent(t, "a1", "")
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	openEcho(t, s, echo)
	pipe.fill(t)
	s.proc.signal(t, syscall.SIGTERM)
	start := time.Now()
	const bound = 8 * time.Second // --graceful-shutdown-timeout=2s, a second for the log
	select {
	case <-s.proc.done:
	case <-time.After(bound):
		t.Fatalf("the server still runs %v after SIGTERM, its log pipe full", bound)
	}
	t.Logf("SIGTERM with the log pipe full and a tunnel open: exited after %v (%v)", time.Since(start).Round(time.Millisecond), s.proc.waitErr)
}

// testLogPipeAgent: an agent whose log pipe is full carries the dials of
// a server that restarted (it logs as it takes the new connection); its
// reader gone, the agent stays and goes on carrying them.
func testLogPipeAgent(t *testing.T) {
	s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS)
	pipe := newLogPipe(t)
	a := s.launchAgentOut(t, konnectivityBin, nil, pipe.w, s.pki, "a1", "")
	waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
	agentMetrics := fmt.Sprintf("http://127.0.0.1:%d/metrics", a.adminPort)
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	held := openEcho(t, s, echo)
	heldR := bufio.NewReader(held)
	pipe.fill(t)

	restart := func(what string) {
		t.Helper()
		before := startTime(metricsURL)
		s.proc.signal(t, syscall.SIGHUP)
		took := waitNewImage(t, s.proc, metricsURL, before, 15*time.Second)
		s.waitAgents(t, 1, 10*time.Second)
		held.SetDeadline(time.Now().Add(10 * time.Second))
		if err := echoOnce(held, heldR, what+"\n"); err != nil {
			t.Fatalf("the tunnel held across the server's restart, %s: %v", what, err)
		}
		dialEchoes(t, s, echo, 9, "through the agent after the server's restart, "+what)
		t.Logf("server SIGHUP, %s: the next image served after %v; the tunnel kept, 9 of 9 dials through the agent served", what, took.Round(time.Millisecond))
	}
	restart("the agent's log pipe full")

	pipe.closeReader()
	before := metricValue(t, agentMetrics, agtPrefix+"log_lines_dropped_total")
	restart("the agent's log pipe's reader gone")
	waitFor(t, 10*time.Second, "the agent's log lines dropped for the reader gone", func() bool {
		if a.proc.exited() {
			t.Fatalf("the agent exited once its log pipe's reader closed: %v", a.proc.waitErr)
		}
		return metricValue(t, agentMetrics, agtPrefix+"log_lines_dropped_total") > before
	})
	dialEchoes(t, s, echo, 3, "through the agent, its log pipe's reader gone")
	if a.proc.exited() {
		t.Fatalf("the agent exited: %v", a.proc.waitErr)
	}
}

// refusedLogin logs in on s's agent port with a credential that is not a
// bearer token, which the server refuses (401) and logs at WARN, and
// returns the answer's status.
func refusedLogin(s *server, conf *tls.Config, id string) (int, error) {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", "127.0.0.1:"+strconv.Itoa(s.agentPort), conf)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(conn, "GET /konnectivity/v1/tunnel HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: konnectivity-h2\r\nKonnectivity-Agent-Id: %s\r\nAuthorization: Basic eDp5\r\n\r\n", id); err != nil {
		return 0, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// badConnect sends a request the front door refuses (400) and logs at
// debug, and waits for the answer.
func badConnect(sock string) error {
	c, err := net.DialTimeout("unix", sock, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "NOT A CONNECT\r\n\r\n"); err != nil {
		return err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest {
		return fmt.Errorf("answered %d, want 400", resp.StatusCode)
	}
	return nil
}

// listed is how many times s's /debug/tunnels lists agent id.
func listed(t *testing.T, s *server, id string) int {
	t.Helper()
	var st struct {
		Agents []struct {
			ID string `json:"id"`
		} `json:"agents"`
	}
	getJSON(t, fmt.Sprintf("http://127.0.0.1:%d/debug/tunnels", s.adminPort), &st)
	n := 0
	for _, a := range st.Agents {
		if a.ID == id {
			n++
		}
	}
	return n
}

// dialEchoes opens n tunnels to echo through s, one after another, each
// with one round trip, each within 10 s.
func dialEchoes(t *testing.T, s *server, echo *tcpBackend, n int, what string) {
	t.Helper()
	d := s.egressDialer(t).bounded()
	for i := range n {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		start := time.Now()
		c, err := d(ctx, "tcp", echo.addr())
		cancel()
		if err != nil {
			t.Fatalf("dial %d of %d %s: %v after %v", i+1, n, what, err, time.Since(start).Round(time.Millisecond))
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		err = echoOnce(c, bufio.NewReader(c), "hello\n")
		c.Close()
		if err != nil {
			t.Fatalf("dial %d of %d %s: %v", i+1, n, what, err)
		}
	}
}
