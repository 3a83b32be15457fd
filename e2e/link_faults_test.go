package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// deadRelay forwards TCP connections from a loopback listener to a
// backend until kill, which makes every connection silently dead: from
// then on nothing is forwarded either way and nothing is closed, as when a
// link drops every packet. Both ends' sockets stay open until the test
// ends.
type deadRelay struct {
	l       net.Listener
	dead    chan struct{}
	killed  sync.Once
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []net.Conn
	relayed atomic.Int64 // connections accepted and forwarded
}

func startDeadRelay(t *testing.T, backend string) *deadRelay {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &deadRelay{l: l, dead: make(chan struct{})}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
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
			r.mu.Lock()
			r.conns = append(r.conns, c, b)
			r.mu.Unlock()
			r.relayed.Add(1)
			r.wg.Add(2)
			go r.pipe(b, c)
			go r.pipe(c, b)
		}
	}()
	t.Cleanup(func() {
		r.kill()
		l.Close()
		r.mu.Lock()
		for _, c := range r.conns {
			c.Close()
		}
		r.mu.Unlock()
		r.wg.Wait()
	})
	return r
}

func (r *deadRelay) port() int { return r.l.Addr().(*net.TCPAddr).Port }

func (r *deadRelay) kill() { r.killed.Do(func() { close(r.dead) }) }

// pipe copies src to dst until the relay is killed; what it reads after
// that is dropped, and it reads no more.
func (r *deadRelay) pipe(dst, src net.Conn) {
	defer r.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		select {
		case <-r.dead:
			return // the sockets stay open: the test's cleanup closes them
		default:
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Two agents, one of whose links goes silently dead (nothing either way,
// nothing closed): the dials that meet the dead link are not lost. The
// server finds the link dead within seconds, well before keepalive and
// PING timeout (45 s), and retries those dials on the healthy agent.
func TestFaultSilentlyDeadAgentLink(t *testing.T) {
	const dialTimeout = 10 * time.Second
	s := startServer(t, "--backend-dial-timeout="+dialTimeout.String(), "--proxy-strategies=default")
	s.startAgent(t, "healthy", "")
	relay := startDeadRelay(t, fmt.Sprintf("127.0.0.1:%d", s.agentPort))
	dead := startAgentArgs(t, "dead", mtlsAgentArgs(s.pki, "127.0.0.1", relay.port())...)
	waitHTTP(t, dead.proc, dead.healthURL("/readyz"), http.StatusOK)
	s.waitAgents(t, 2, startTimeout)
	backend := startHTTPBackend(t, "127.0.0.1", "b")
	client := s.egressDialer(t).httpClient(false, nil)
	client.Timeout = 3 * dialTimeout

	// Both agents carry dials before the link dies.
	ctx, cancel := context.WithTimeout(context.Background(), 4*dialTimeout)
	defer cancel()
	for i := range 4 {
		if err := getHello(ctx, client, backend, "b", i); err != nil {
			t.Fatalf("before the link died: %v", err)
		}
	}

	relay.kill()
	killed := time.Now()
	const n = 20 // at once: the server spreads them over both agents
	type result struct {
		took time.Duration
		err  error
	}
	results := make(chan result, n)
	for i := range n {
		go func() {
			start := time.Now()
			err := getHello(ctx, client, backend, "b", 100+i)
			results <- result{time.Since(start), err}
		}()
	}
	failed, slowest := 0, time.Duration(0)
	var errs []string
	for range n {
		r := <-results
		slowest = max(slowest, r.took)
		if r.err != nil {
			failed++
			if len(errs) < 3 {
				errs = append(errs, r.err.Error())
			}
		}
	}
	gone := s.agentCount() == 1
	t.Logf("%d of %d dials failed after the link died; the slowest took %v; the dead agent dropped: %v, %v after the link died",
		failed, n, slowest.Round(time.Millisecond), gone, time.Since(killed).Round(time.Millisecond))
	if failed > 0 {
		t.Errorf("%d of %d dials failed on a silently dead link beside a healthy agent: %s", failed, n, strings.Join(errs, "; "))
	}
	if !gone {
		t.Errorf("the server still lists the agent whose link is dead, %v after it died", time.Since(killed).Round(time.Millisecond))
	}
	if relay.relayed.Load() != 1 {
		t.Errorf("the relay carried %d agent connections, want 1", relay.relayed.Load())
	}
}

// Two agent processes with one ID and one certificate (a cloned node):
// each login replaces the other's connection. The replaced one backs off
// before it logs in again, so the two take turns a few times in ten
// seconds, not thousands; the server reports the run in one line with a
// count instead of a login line and a disconnect line for each.
func TestFaultClonedAgentBacksOff(t *testing.T) {
	s := startServer(t)
	one := s.launchAgent(t, s.pki, "clone", "")
	two := s.launchAgent(t, s.pki, "clone", "")
	logins := func() int {
		return strings.Count(one.proc.out.String(), "connected to server") + strings.Count(two.proc.out.String(), "connected to server")
	}
	waitFor(t, 30*time.Second, "both agents logged in", func() bool {
		return strings.Contains(one.proc.out.String(), "connected to server") && strings.Contains(two.proc.out.String(), "connected to server")
	})
	const window = 15 * time.Second
	before, linesBefore := logins(), strings.Count(s.proc.out.String(), "agent connected")
	time.Sleep(window) // the count over a stretch of time is what is measured
	got, lines := logins()-before, strings.Count(s.proc.out.String(), "agent connected")-linesBefore
	const storm = "agent ID replaced over and over"
	reports := strings.Count(s.proc.out.String(), storm)
	t.Logf("%d logins in %v by two agents sharing one ID; the server logged %d of them as logins, and reported the run %d times",
		got, window, lines, reports)
	if got >= 50 {
		t.Errorf("%d logins in %v by two agents sharing one ID: they replace each other without backing off", got, window)
	}
	if got == 0 {
		t.Errorf("no login in %v: the two agents no longer take turns", window)
	}
	if lines > 2 || reports == 0 {
		t.Errorf("the server logged %d logins of the cloned agents in %v and %d reports of their run, want at most 2 and a report", lines, window, reports)
	}
}
