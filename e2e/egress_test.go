package e2e

import (
	"bufio"
	"bytes"
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
)

// get fetches url with client and returns the body, failing on non-200.
func get(ctx context.Context, client *http.Client, url string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", fmt.Errorf("read body of %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s: status %d body %q", url, resp.StatusCode, body)
	}
	return string(body), nil
}

// getHello GETs /hello?i=i through client from the HTTP backend at addr
// that names itself name; an error if the request fails or another
// backend answered.
func getHello(ctx context.Context, client *http.Client, addr, name string, i int) error {
	body, err := get(ctx, client, fmt.Sprintf("http://%s/hello?i=%d", addr, i))
	if err != nil {
		return err
	}
	if want := fmt.Sprintf("hello %s %d", name, i); body != want {
		return fmt.Errorf("body %q, want %q", body, want)
	}
	return nil
}

// TestEgressRequests sends HTTP requests through kube-apiserver's own
// HTTPConnect egress dialer → server UDS → agent → loopback backend.
func TestEgressRequests(t *testing.T) {
	s := startServer(t, "--route-agents=a1") // a1 advertises default-route
	s.startAgent(t, "a1", "ipv4=127.0.0.1&default-route=true")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialer(t)

	t.Run("sequential-new-tunnel-each", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		var dials int64counter
		client := d.httpClient(false, &dials)
		const n = 200
		start := time.Now()
		for i := range n {
			if err := getHello(ctx, client, backend, "b1", i); err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
		}
		if got := dials.get(); got != n {
			t.Errorf("tunnels dialled = %d, want %d (one per request)", got, n)
		}
		t.Logf("%d sequential requests, one tunnel each, in %v", n, time.Since(start).Round(time.Millisecond))
	})

	t.Run("concurrent-new-tunnel-each", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		client := d.httpClient(false, nil)
		const n, parallel = 200, 200
		sem := make(chan struct{}, parallel)
		var wg sync.WaitGroup
		errs := make(chan error, n)
		start := time.Now()
		for i := range n {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				if err := getHello(ctx, client, backend, "b1", i); err != nil {
					errs <- fmt.Errorf("request %d: %w", i, err)
				}
			}()
		}
		wg.Wait()
		close(errs)
		var failed int
		for err := range errs {
			failed++
			if failed <= 5 {
				t.Error(err)
			}
		}
		if failed > 0 {
			t.Fatalf("%d of %d concurrent requests failed", failed, n)
		}
		t.Logf("%d requests, %d in parallel, in %v", n, parallel, time.Since(start).Round(time.Millisecond))
	})

	t.Run("keepalive-one-tunnel", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		var dials int64counter
		client := d.httpClient(true, &dials)
		defer client.CloseIdleConnections()
		const n = 200
		for i := range n {
			if err := getHello(ctx, client, backend, "b1", i); err != nil {
				t.Fatalf("request %d: %v", i, err)
			}
		}
		if got := dials.get(); got != 1 {
			t.Errorf("tunnels dialled = %d, want 1 (keep-alive reuses the tunnel)", got)
		}
	})

	t.Run("large-bodies", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		client := d.httpClient(false, nil)
		const size = 8 << 20
		body, err := get(ctx, client, fmt.Sprintf("http://%s/big?n=%d", backend, size))
		if err != nil {
			t.Fatal(err)
		}
		if len(body) != size || sha([]byte(body)) != sha(pattern(size)) {
			t.Fatalf("download: got %d bytes sha %s, want %d bytes sha %s",
				len(body), sha([]byte(body)), size, sha(pattern(size)))
		}
		up := pattern(4 << 20)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+backend+"/echo", bytes.NewReader(up))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("upload: %v", err)
		}
		defer resp.Body.Close()
		echoed, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("upload: read echo: %v", err)
		}
		if !bytes.Equal(echoed, up) {
			t.Fatalf("upload: echoed %d bytes sha %s, want %d bytes sha %s", len(echoed), sha(echoed), len(up), sha(up))
		}
	})
}

// TestDialClosedPort: the agent's dial to a closed loopback port is
// refused at once, and the server must report that as 502, which the
// egress dialer surfaces as "code 502".
func TestDialClosedPort(t *testing.T) {
	s := startServer(t)
	s.startAgent(t, "a1", "")
	d := s.egressDialer(t)
	addr := closedPort(t)
	el, err := dialErr(t, d, addr, 10*time.Second)
	if err == nil {
		t.Fatalf("dial to closed port %s succeeded", addr)
	}
	if !strings.Contains(err.Error(), "code 502") {
		t.Fatalf("dial to closed port %s: got error %q after %v, want one with \"code 502\"", addr, err, el)
	}
	t.Logf("closed port: %v after %v", err, el.Round(time.Millisecond))
}

func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// TestNoAgent: with no agent connected, the server waits --agent-wait for
// one and then answers 503; an agent that arrives during the wait is used.
func TestNoAgent(t *testing.T) {
	t.Run("503-after-agent-wait", func(t *testing.T) {
		s := startServer(t, "--agent-wait=2s")
		if got := getStatus(t, s.healthURL("/readyz")); got != http.StatusServiceUnavailable {
			t.Errorf("/readyz with no agent = %d, want 503", got)
		}
		backend := startHTTPBackend(t, "127.0.0.1", "b1")
		d := s.egressDialer(t)
		el, err := dialErr(t, d, backend, 10*time.Second)
		if err == nil {
			t.Fatal("dial with no agent succeeded")
		}
		if !strings.Contains(err.Error(), "code 503") {
			t.Fatalf("dial with no agent: got %q after %v, want \"code 503\"", err, el)
		}
		t.Logf("no agent: %v after %v", err, el.Round(time.Millisecond))
	})

	t.Run("agent-arrives-during-wait", func(t *testing.T) {
		s := startServer(t, "--agent-wait=10s")
		backend := startHTTPBackend(t, "127.0.0.1", "b1")
		client := s.egressDialer(t).httpClient(false, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		type result struct {
			body string
			err  error
		}
		res := make(chan result, 1)
		go func() {
			body, err := get(ctx, client, "http://"+backend+"/hello?i=7")
			res <- result{body, err}
		}()
		// Give the dial time to reach the server's wait before the agent
		// exists; the outcome does not depend on this delay.
		time.Sleep(300 * time.Millisecond)
		s.startAgent(t, "late", "")
		r := <-res
		if r.err != nil {
			t.Fatalf("request started before the agent connected: %v", r.err)
		}
		if r.body != "hello b1 7" {
			t.Fatalf("body %q", r.body)
		}
	})
}

// TestDestHostRouting checks --proxy-strategies=destHost,default.
//
// Both agents dial backends from the same host, so a backend cannot tell
// which agent carried a connection. Instead we freeze one agent with
// SIGSTOP: its TLS connection to the server stays up (the kernel keeps
// buffering), so the server still considers it connected and routes to it,
// but it cannot answer dials. Then:
//   - a dial to the frozen agent's identifier goes to the frozen agent
//     first (destHost picked it); it gets no answer, the server finds the
//     link dead with a PING (docs/server.md) and drops the agent, and the
//     dial is served through the live one by the default strategy, within
//     --backend-dial-timeout;
//   - N dials to the live agent's identifier must all succeed: with random
//     (default) routing each would have a 1/2 chance of hitting the frozen
//     agent, so N=10 passes by chance with probability 2^-10.
//
// The roles are then swapped, and a destination matching no identifier
// must still work through the default strategy.
func TestDestHostRouting(t *testing.T) {
	for _, ip := range []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"} {
		l, err := net.Listen("tcp", ip+":0")
		if err != nil {
			t.Skipf("cannot listen on %s (needs all of 127/8 on loopback, as on Linux): %v", ip, err)
		}
		l.Close()
	}
	s := startServer(t, "--proxy-strategies=destHost,default", "--backend-dial-timeout=2s")
	agentA := s.startAgent(t, "agent-a", "ipv4=127.0.0.2")
	agentB := s.startAgent(t, "agent-b", "ipv4=127.0.0.3")
	backendA := startHTTPBackend(t, "127.0.0.2", "A")
	backendB := startHTTPBackend(t, "127.0.0.3", "B")
	backendOther := startHTTPBackend(t, "127.0.0.4", "other")
	d := s.egressDialer(t)

	// Sanity: everything reachable while both agents run.
	checkReachable(t, d, backendA, "A", 3)
	checkReachable(t, d, backendB, "B", 3)
	checkReachable(t, d, backendOther, "other", 3)

	frozen := func(t *testing.T, stop *agent, live, dead, liveName string) {
		stop.proc.freeze(t)
		defer stop.proc.signal(t, syscall.SIGCONT)
		checkReachable(t, d, live, liveName, 10)
		el, err := dialErr(t, d, dead, 15*time.Second)
		if err != nil {
			t.Fatalf("dial to %s while its agent %s is frozen: %v after %v; want it served through the live agent once the frozen link is found dead", dead, stop.id, err, el)
		}
		t.Logf("frozen %s: dial %s served after %v", stop.id, dead, el.Round(time.Millisecond))
		// The frozen agent comes back after SIGCONT and logs in again.
		stop.proc.signal(t, syscall.SIGCONT)
		s.waitAgents(t, 2, 30*time.Second)
	}
	t.Run("freeze-b", func(t *testing.T) { frozen(t, agentB, backendA, backendB, "A") })
	t.Run("freeze-a", func(t *testing.T) { frozen(t, agentA, backendB, backendA, "B") })

	// After SIGCONT both agents must serve again, and a destination no
	// agent claims goes through the default strategy.
	t.Run("after-resume", func(t *testing.T) {
		checkReachable(t, d, backendA, "A", 3)
		checkReachable(t, d, backendB, "B", 3)
		checkReachable(t, d, backendOther, "other", 5)
	})
}

// checkReachable makes n requests, one tunnel each, to backend (whose
// /hello names itself name).
func checkReachable(t *testing.T, d dialFunc, backend, name string, n int) {
	t.Helper()
	if err := reach(d, backend, name, n); err != nil {
		t.Fatal(err)
	}
}

func reach(d dialFunc, backend, name string, n int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client := d.httpClient(false, nil)
	for i := range n {
		if err := getHello(ctx, client, backend, name, i); err != nil {
			return fmt.Errorf("request %d to %s: %w", i, backend, err)
		}
	}
	return nil
}

// TestStalledConnection: a tunnel that stopped moving must not hold up
// another tunnel through the same agent (head-of-line blocking, ANP #881
// for a client that stopped reading, ANP #180 for a backend that stopped
// reading). No timing ratio is asserted, only a generous overall bound.
func TestStalledConnection(t *testing.T) {
	s := startServer(t)
	s.startAgent(t, "a1", "")
	d := s.egressDialer(t).bounded()
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)

	t.Run("client-not-reading", func(t *testing.T) {
		var written atomic.Int64
		hose := startTCPBackend(t, "127.0.0.1", firehoseHandler(&written))
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		stalled, err := d(ctx, "tcp", hose.addr())
		if err != nil {
			t.Fatalf("dial firehose: %v", err)
		}
		defer stalled.Close()
		if _, err := stalled.Write([]byte{'!'}); err != nil {
			t.Fatalf("start firehose: %v", err)
		}
		// Unbounded buffering would never plateau, which is itself a bug.
		n := waitPlateau(t, &written, "backend writing into a tunnel whose client never reads")
		t.Logf("stalled tunnel holds %d bytes in flight towards the client", n)

		echoMany(t, d, echo.addr(), 200)

		// The stalled tunnel must resume and deliver the firehose's bytes
		// intact once we read it.
		if err := stalled.SetReadDeadline(time.Now().Add(15 * time.Second)); err != nil {
			t.Fatal(err)
		}
		const want = 4 << 20
		got := make([]byte, want)
		if _, err := io.ReadFull(stalled, got); err != nil {
			t.Fatalf("reading the formerly stalled tunnel: %v", err)
		}
		chunk := pattern(32 << 10)
		for off := 0; off < want; off += len(chunk) {
			if !bytes.Equal(got[off:off+len(chunk)], chunk) {
				t.Fatalf("formerly stalled tunnel: data corrupt in chunk at offset %d", off)
			}
		}
	})

	t.Run("backend-not-reading", func(t *testing.T) {
		release := make(chan struct{})
		var received atomic.Int64
		sink := startTCPBackend(t, "127.0.0.1", func(c net.Conn) {
			<-release // never read until released
			n, _ := io.Copy(io.Discard, c)
			received.Add(n)
		})
		// Registered after startTCPBackend, so it runs before the
		// backend's cleanup waits for its handlers.
		var releaseOnce sync.Once
		releaseAll := func() { releaseOnce.Do(func() { close(release) }) }
		t.Cleanup(releaseAll)

		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		stalled, err := d(ctx, "tcp", sink.addr())
		if err != nil {
			t.Fatalf("dial sink: %v", err)
		}
		defer stalled.Close()
		var sent atomic.Int64
		writerDone := make(chan struct{})
		const total = 64 << 20
		go func() {
			defer close(writerDone)
			chunk := pattern(32 << 10)
			for sent.Load() < total {
				n, err := stalled.Write(chunk)
				sent.Add(int64(n))
				if err != nil {
					return
				}
			}
		}()
		n := waitPlateau(t, &sent, "client writing into a tunnel whose backend never reads")
		t.Logf("stalled tunnel holds %d bytes in flight towards the backend", n)

		echoMany(t, d, echo.addr(), 200)

		// Release the backend: everything written so far must arrive,
		// and the writer must finish the rest.
		releaseAll()
		select {
		case <-writerDone:
		case <-time.After(30 * time.Second):
			t.Fatalf("writer still blocked 30 s after the backend started reading (%d of %d sent)", sent.Load(), total)
		}
		if got := sent.Load(); got != total {
			t.Fatalf("writer stopped after %d of %d bytes", got, total)
		}
		if err := stalled.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
			t.Fatalf("CloseWrite: %v", err)
		}
		waitFor(t, 30*time.Second, "backend received everything", func() bool { return received.Load() == total })
	})
}

// waitPlateau waits until *counter stops growing (unchanged across 500 ms)
// and returns its value; it fails if that takes longer than 20 s.
func waitPlateau(t *testing.T, counter *atomic.Int64, what string) int64 {
	t.Helper()
	var last int64 = -1
	deadline := time.Now().Add(20 * time.Second)
	for {
		time.Sleep(500 * time.Millisecond)
		cur := counter.Load()
		if cur == last && cur > 0 {
			return cur
		}
		last = cur
		if time.Now().After(deadline) {
			t.Fatalf("%s never stalled: %d bytes so far (unbounded buffering?)", what, cur)
		}
	}
}

// echoMany opens a new tunnel to an echo backend and does n small
// request/response round trips on it, all within 10 s.
func echoMany(t *testing.T, d dialFunc, addr string, n int) {
	t.Helper()
	echoWithin(t, d, addr, n, 10*time.Second, true)
}

// echoWithin is echoMany within bound; without deadlines (a conn that has
// none) a timer closes the conn at bound instead.
func echoWithin(t *testing.T, d dialFunc, addr string, n int, bound time.Duration, deadlines bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	start := time.Now()
	conn, err := d(ctx, "tcp", addr)
	if err != nil {
		t.Fatalf("dial echo beside a stalled tunnel: %v", err)
	}
	defer conn.Close()
	if deadlines {
		if err := conn.SetDeadline(start.Add(bound)); err != nil {
			t.Fatal(err)
		}
	} else {
		watchdog := time.AfterFunc(bound, func() { conn.Close() })
		defer watchdog.Stop()
	}
	br := bufio.NewReader(conn)
	for i := range n {
		if err := echoOnce(conn, br, fmt.Sprintf("ping %d\n", i)); err != nil {
			t.Fatalf("echo %d of %d beside a stalled tunnel, after %v: %v", i, n, time.Since(start), err)
		}
	}
	t.Logf("dial + %d echoes beside a stalled tunnel in %v", n, time.Since(start).Round(time.Millisecond))
}
