package server

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/sys/unix"
)

// The pacer gives out moments spaced by half the time a slot takes to
// free, within the bounds.
func TestPacerSpacesRetries(t *testing.T) {
	var p pacer
	p.admitted(64 * time.Millisecond) // 64 slots: one frees every millisecond
	now := time.Now()
	var got []time.Duration
	for range 100 {
		got = append(got, p.retryAfter(now, 64, 0, time.Second))
	}
	if got[0] != wire.MinRetryAfter {
		t.Errorf("first retry in %s, want the floor %s", got[0], wire.MinRetryAfter)
	}
	if want := 100 * 500 * time.Microsecond; got[99] != want {
		t.Errorf("100th retry in %s, want %s (0.5 ms apart)", got[99], want)
	}
	later := now.Add(time.Hour) // the burst long over: the spacing starts again from now
	if r := p.retryAfter(later, 64, 0, time.Second); r != wire.MinRetryAfter {
		t.Errorf("retry after the burst in %s, want %s", r, wire.MinRetryAfter)
	}
	for range 200000 {
		p.retryAfter(later, 1, 0, time.Second)
	}
	if r := p.retryAfter(later, 1, 0, time.Second); r != wire.MaxRetryAfter {
		t.Errorf("retry at a long backlog in %s, want the cap %s", r, wire.MaxRetryAfter)
	}
}

// Refusals at a nearly full backlog come back one slot's time apart from
// now, the rate at which places in the backlog free, whatever is queued.
func TestPacerGivesRoomAtTheSlotRate(t *testing.T) {
	var p pacer
	p.admitted(640 * time.Millisecond) // 64 slots: one frees every 10 ms
	now := time.Now()
	for i := 1; i <= 100; i++ {
		if r, want := p.roomAfter(now, 64), time.Duration(i)*10*time.Millisecond; r != want {
			t.Fatalf("refusal %d: come back in %s, want %s", i, r, want)
		}
	}
	later := now.Add(time.Hour) // the burst long over: the spacing starts again from now
	if r := p.roomAfter(later, 64); r != 10*time.Millisecond {
		t.Errorf("after the burst: come back in %s, want one slot's time", r)
	}
}

// A refusal because the slots stalled, with connections queued ahead of
// it, comes back after half
// the time they take to be admitted, the next half a slot's time later;
// no later than ahead, however long the queue.
func TestPacerWaitsForTheQueue(t *testing.T) {
	var p pacer
	p.admitted(64 * time.Millisecond) // 64 slots: one frees every millisecond
	now := time.Now()
	first := p.retryAfter(now, 64, 1000, 10*time.Second)
	if want := 1000*500*time.Microsecond + 500*time.Microsecond; first != want {
		t.Errorf("retry behind 1000 queued in %s, want %s", first, want)
	}
	if second := p.retryAfter(now, 64, 1000, 10*time.Second); second != first+500*time.Microsecond {
		t.Errorf("the next refusal's retry in %s, want %s", second, first+500*time.Microsecond)
	}
	later := now.Add(time.Hour)
	if r := p.retryAfter(later, 64, 100000, 2*time.Second); r != 2*time.Second+500*time.Microsecond {
		t.Errorf("retry behind 100,000 queued in %s, want the bound 2s and a step", r)
	}
}

// Past the unadmitted limit a connection waits in the listen backlog,
// unaccepted, and is admitted once a slot frees, with no refusal: a raw
// TCP connection past the limit is neither answered nor closed, and a good
// agent queued behind it connects as soon as the holders leave.
func TestUnadmittedWaitInBacklog(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const limit = 4
	e := newEnv(t, func(c *Config) {
		c.MaxUnadmitted = limit
		c.HeaderTimeout = time.Minute // no stall within the test: the holders free the slots
	})
	echo := tunneltest.EchoServer(t)
	var holders []net.Conn
	for range limit {
		c, err := net.Dial("tcp", e.AgentAddr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		holders = append(holders, c)
	}
	tunneltest.WaitUntil(t, func() bool { return e.srv.gate.open.Load() == limit }, "the server to count the holders")

	// A raw connection past the limit: the kernel completes its handshake,
	// the server does not accept it.
	extra, err := net.Dial("tcp", e.AgentAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	tunneltest.WaitUntil(t, func() bool { return acceptQueue(t, e.AgentAddr) == 1 }, "the connection past the limit to wait in the backlog")
	e.startAgent("queued", "", nil)
	tunneltest.WaitUntil(t, func() bool { return acceptQueue(t, e.AgentAddr) == 2 }, "the agent to wait in the backlog")
	if n := e.srv.gate.open.Load(); n != limit {
		t.Fatalf("%d connections counted as waiting, want the limit %d", n, limit)
	}
	if n := e.srv.AgentCount(); n != 0 {
		t.Fatalf("%d agents admitted past the limit", n)
	}

	// The slots free: both are accepted in arrival order, the agent is
	// admitted, and nobody was refused.
	for _, c := range holders {
		c.Close()
	}
	e.WaitAgents(1)
	if err := e.EchoOnce(echo); err != nil {
		t.Fatalf("dial through the agent that waited: %v", err)
	}
	if n := e.srv.gate.dropped.Value(); n != 0 {
		t.Fatalf("%v connections refused at the limit, want none", n)
	}
	extra.Close()
	tunneltest.WaitUntil(t, func() bool { return e.srv.gate.open.Load() == 0 }, "no connection left waiting")
}

// acceptQueue is the number of connections waiting in the backlog of the
// TCP listener at addr (a listening socket's rx_queue in /proc/net/tcp).
func acceptQueue(t *testing.T, addr string) int {
	t.Helper()
	_, port, _ := net.SplitHostPort(addr)
	p, _ := strconv.Atoi(port)
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf(":%04X", p)
	for _, line := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(line)
		// sl local_address rem_address st tx_queue:rx_queue ...; 0A is LISTEN.
		if len(f) < 5 || !strings.HasSuffix(f[1], want) || f[3] != "0A" {
			continue
		}
		_, rx, _ := strings.Cut(f[4], ":")
		n, err := strconv.ParseInt(rx, 16, 64)
		if err != nil {
			t.Fatalf("/proc/net/tcp: %q: %v", line, err)
		}
		return int(n)
	}
	t.Fatalf("no listener on %s in /proc/net/tcp", addr)
	return 0
}

// When the listen backlog is nearly full, a connection past the limit is
// accepted and refused with a moment to come back no earlier than the
// queued connections ahead of it take, instead of the kernel dropping SYNs
// once the backlog overflows.
func TestNearlyFullBacklogRefuses(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const limit, backlog = 2, 8
	e := newEnv(t, func(c *Config) {
		c.MaxUnadmitted = limit
		c.HeaderTimeout = time.Minute // no stall within the test
	})
	srv := e.srv
	ln := listenBacklog(t, backlog) // a second agent port, with a small backlog
	done := make(chan struct{})
	go func() { defer close(done); srv.ServeAgents(ln) }()
	defer func() { ln.Close(); <-done }()
	addr := ln.Addr().String()

	var conns []net.Conn
	dial := func() net.Conn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		return c
	}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range limit {
		dial()
	}
	tunneltest.WaitUntil(t, func() bool { return srv.gate.open.Load() == limit }, "the server to count the holders")
	// Below nearly full the connections wait.
	for range nearlyFullAt(backlog) - 1 {
		dial()
	}
	tunneltest.WaitUntil(t, func() bool { return acceptQueue(t, addr) == nearlyFullAt(backlog)-1 }, "the connections to wait in the backlog")
	if n := srv.gate.dropped.Value(); n != 0 {
		t.Fatalf("%v refused below nearly full", n)
	}
	// Nearly full, the oldest waiting one is refused, told to come
	// back after one slot's time: it needs a place in the backlog, which
	// frees with each admission, not its turn behind those queued.
	dial()
	c := conns[limit]
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("the oldest waiting connection: %v, want a 503", err)
	}
	resp.Body.Close()
	r := wire.RetryAfterHeader(resp.Header)
	if resp.StatusCode != http.StatusServiceUnavailable || r < wire.MinRetryAfter {
		t.Fatalf("the oldest waiting connection got %s, retry after %s; want 503 with a moment to come back", resp.Status, r)
	}
	srv.gate.pace.mu.Lock()
	slot := srv.gate.pace.slotTimeLocked() / limit
	srv.gate.pace.mu.Unlock()
	if r > max(slot, wire.MinRetryAfter) {
		t.Errorf("told to come back in %s, want one slot's time (%s): a place in the backlog, not the queue's turn", r, slot)
	}
	if n := srv.gate.open.Load(); n != limit {
		t.Fatalf("%d counted as unadmitted, want the limit %d", n, limit)
	}
	t.Logf("backlog %d of %d: the oldest refused, told to come back in %s", nearlyFullAt(backlog), backlog, r)
}

// listenBacklog is a loopback TCP listener whose backlog holds n.
func listenBacklog(t *testing.T, n int) net.Listener {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	if err := unix.Listen(fd, n); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "listener")
	defer f.Close()
	ln, err := net.FileListener(f)
	if err != nil {
		t.Fatal(err)
	}
	return ln
}
