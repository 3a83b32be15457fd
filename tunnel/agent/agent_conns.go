package agent

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/sys/unix"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// target is one address the agent dials. serverName is the name the
// server's certificate must carry: the configured host, even when addr is
// one of its resolved addresses.
type target struct {
	addr       string
	serverName string
}

// connToServer is the agent's connection to one server: the TLS connection
// and, once HTTP/2 runs on it, its link.
type connToServer struct {
	id    string
	addr  string
	since time.Time
	count int
	conn  *wire.WatchedConn
	done  chan struct{} // closed when the link has stopped serving

	link      atomic.Pointer[h2link.Conn] // set once HTTP/2 runs on conn
	drainOnce sync.Once
	drain     chan struct{} // closed to ask the control stream to announce a drain
	tunnels   atomic.Int64  // open tunnels on this connection (MaxStreams), counted with Stats.Tunnels (takeTunnel)
	token     string        // the token presented at login; read-only
	// agentRestart: the server named featureAgentRestart, so a restart in
	// place announces itself to it (wire.ControlRestartIn); read-only.
	agentRestart bool
}

func (l *connToServer) sendDrain() { l.drainOnce.Do(func() { close(l.drain) }) }

// startManagers starts one goroutine per configured address: a seeker for
// a single (load-balanced) address, a redialer for each of several fixed
// addresses, a resolver that runs redialers when DNS expansion is on.
func (a *Agent) startManagers(ctx context.Context) *sync.WaitGroup {
	var wg sync.WaitGroup
	run := func(f func()) {
		wg.Add(1)
		go func() { defer wg.Done(); f() }()
	}
	for _, addr := range a.cfg.ServerAddrs {
		host, port, _ := net.SplitHostPort(addr)
		t := target{addr: addr, serverName: host}
		switch {
		case a.cfg.ExpandDNS && net.ParseIP(host) == nil:
			run(func() { a.expand(ctx, host, port) })
		case len(a.cfg.ServerAddrs) == 1 && !a.cfg.ExpandDNS:
			run(func() { a.seek(ctx, t) })
		default:
			run(func() { a.redial(ctx, t) })
		}
	}
	return &wg
}

// seek dials a load-balanced address until the agent holds a connection to as
// many distinct servers as the servers announce. Each dial names the
// servers already connected, so a duplicate is refused (409) before any costly
// check; a duplicate is expected here and is retried quickly, not backed off.
func (a *Agent) seek(ctx context.Context, t target) {
	b := newBackoff(a.cfg.SyncInterval, a.cfg.SyncCap)
	dupes := 0
	for a.waitLogin(ctx) {
		changed := a.changedChan()
		if n, want := a.connected(); n >= want {
			probe := a.cfg.SyncForever
			wait := (<-chan time.Time)(nil)
			if probe {
				wait = time.After(jitter(a.cfg.SyncCap))
			}
			select {
			case <-ctx.Done():
				return
			case <-changed:
				continue
			case <-wait:
			}
		}
		l, err := a.dial(ctx, t)
		var delay time.Duration
		switch {
		case err == nil:
			dupes = 0
			b.reset()
			if !a.startConn(l) {
				return
			}
			continue
		case ctx.Err() != nil:
			return
		case isDuplicate(err):
			// The balancer sent us to a server we hold: try again at once,
			// slowing down only if it keeps doing so.
			dupes++
			delay = min(time.Duration(dupes)*5*time.Millisecond, a.cfg.SyncInterval)
		default:
			delay = a.failureDelay(t, err, b)
		}
		if !kubeapi.Sleep(ctx, delay) {
			return
		}
	}
}

// failureDelay is how long to wait after a failed dial, and logs it
// (rate-limited). A server that said when to come back (its unadmitted
// limit) is retried then, spread over an eighth of that more, so a fleet
// that reconnects at once arrives at the rate the server admits; a refused
// connection costs the server nothing, so it is retried at the base
// interval; anything else backs off.
func (a *Agent) failureDelay(t target, err error, b *backoff) time.Duration {
	delay := b.next()
	if r := retryAfter(err); r > 0 {
		delay = r + rand.N(r/8+1)
	} else if isCheap(err) {
		delay = jitter(a.cfg.SyncInterval)
	}
	a.metrics.toServerFailures.Inc()
	a.warnings.Log(a.log, slog.LevelWarn, t.addr+" "+err.Error(), "server connection failed", "server", t.addr, "err", err, "retry_in", delay.Round(time.Millisecond).String())
	return delay
}

// redial keeps one connection to a fixed address, dialling it again when
// it drops.
func (a *Agent) redial(ctx context.Context, t target) {
	b := newBackoff(a.cfg.SyncInterval, a.cfg.SyncCap)
	for a.waitLogin(ctx) {
		l, err := a.dial(ctx, t)
		var delay time.Duration
		switch {
		case err == nil:
			b.reset()
			if !a.startConn(l) {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-l.done:
			}
			// Come back quickly after a drop (a server restart or GOAWAY).
			delay = jitter(a.cfg.SyncInterval)
		case ctx.Err() != nil:
			return
		case isDuplicate(err):
			delay = jitter(a.cfg.SyncCap) // another address reaches the same server
		default:
			delay = a.failureDelay(t, err, b)
		}
		if !kubeapi.Sleep(ctx, delay) {
			return
		}
	}
}

// expand resolves host to all its addresses and holds a connection to each,
// re-resolving every SyncCap so replaced servers are followed.
func (a *Agent) expand(ctx context.Context, host, port string) {
	redialers := map[string]context.CancelFunc{}
	var wg sync.WaitGroup
	defer func() {
		for _, stop := range redialers {
			stop()
		}
		wg.Wait()
	}()
	b := newBackoff(a.cfg.SyncInterval, a.cfg.SyncCap)
	for {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		addrs, err := a.cfg.Resolver(rctx, host)
		cancel()
		delay := jitter(a.cfg.SyncCap)
		if err != nil || len(addrs) == 0 {
			delay = b.next()
			a.log.Warn("resolve server host failed", "host", host, "err", err, "retry_in", delay.Round(time.Millisecond).String())
		} else {
			b.reset()
			seen := map[string]bool{}
			for _, ip := range addrs {
				addr := net.JoinHostPort(ip.Unmap().String(), port)
				seen[addr] = true
				if redialers[addr] != nil {
					continue
				}
				hctx, stop := context.WithCancel(ctx)
				redialers[addr] = stop
				wg.Add(1)
				go func() { defer wg.Done(); a.redial(hctx, target{addr: addr, serverName: host}) }()
			}
			for addr, stop := range redialers {
				if !seen[addr] {
					stop() // its link, if any, ends when the server goes
					delete(redialers, addr)
				}
			}
		}
		if !kubeapi.Sleep(ctx, delay) {
			return
		}
	}
}

// retryAfter is how long a refusal told the agent to stay away; 0 if it did not.
func retryAfter(err error) time.Duration {
	var se *wire.StatusError
	if errors.As(err, &se) {
		return se.RetryAfter
	}
	return 0
}

func isDuplicate(err error) bool {
	var se *wire.StatusError
	return errors.As(err, &se) && se.Code == http.StatusConflict
}

// isCheap reports failures that cost the server nothing (nobody listening),
// so retrying at the base interval is fine and brings the agent back soon
// after the server returns.
func isCheap(err error) bool {
	return errors.Is(err, unix.ECONNREFUSED) || errors.Is(err, unix.ECONNRESET)
}

// dial connects to t, performs the handshake and returns the connection, not yet
// serving.
func (a *Agent) dial(ctx context.Context, t target) (*connToServer, error) {
	hctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	raw, err := a.cfg.ServerDialer(hctx, t.addr)
	if err != nil {
		return nil, fmt.Errorf("dial server %s: %w", t.addr, err)
	}
	conn := raw
	if !a.cfg.PlainForTest {
		tcfg, err := a.cfg.TLS(t.serverName)
		if err != nil {
			raw.Close()
			return nil, fmt.Errorf("TLS configuration: %w", err)
		}
		head := &headRecorder{Conn: raw}
		tc := wire.TlsClient(head, tcfg)
		if err := tc.HandshakeContext(hctx); err != nil {
			raw.Close()
			if herr := head.httpAnswer(t.addr, err); herr != nil {
				return nil, herr
			}
			return nil, fmt.Errorf("TLS handshake with %s: %w", t.addr, err)
		}
		head.done = true
		conn = tc
	}
	hello := wire.OurHello(a.cfg.ID, a.cfg.Identifiers, a.connectedServers())
	if a.cfg.Token != nil {
		if hello.Token, err = a.cfg.Token(); err != nil {
			conn.Close()
			return nil, fmt.Errorf("service account token: %w", err)
		}
	}
	if dl, ok := hctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	if err := wire.WriteHello(conn, t.serverName, hello); err != nil {
		conn.Close()
		return nil, fmt.Errorf("send handshake to %s: %w", t.addr, err)
	}
	// The answer's head is bounded like the agent's request head at the
	// server: a peer that keeps sending header lines is cut off at the
	// bound, not at the deadline.
	lim := &wire.HeadLimiter{R: conn, Remaining: wire.MaxHandshakeHead, Limited: true}
	br := bufio.NewReaderSize(lim, 4096)
	reply, err := wire.ReadReply(br)
	if err != nil {
		conn.Close()
		if errors.Is(err, wire.ErrHeadTooLarge) {
			return nil, fmt.Errorf("server %s: handshake answer head larger than %d bytes", t.addr, wire.MaxHandshakeHead)
		}
		return nil, fmt.Errorf("server %s refused the connection: %w", t.addr, err)
	}
	lim.Limited = false
	conn.SetDeadline(time.Time{})
	return &connToServer{
		id:    reply.ServerID,
		addr:  t.addr,
		since: time.Now(),
		count: reply.Count,
		conn:  wire.NewWatchedConn(&wire.BufferedConn{Conn: conn, R: br}),
		done:  make(chan struct{}),
		drain: make(chan struct{}),
		token: hello.Token,

		agentRestart: reply.AgentRestart,
	}, nil
}

// startConn registers l and serves it in a goroutine the agent owns. It
// returns false (and closes l) when the agent is shutting down, unless it
// still holds destinations for a restarting server: its next image
// resumes them through this connection, which announces the drain at
// once. An agent restarting in place takes no new connection: what it
// holds goes to its own next image.
func (a *Agent) startConn(l *connToServer) bool {
	a.mu.Lock()
	if a.draining {
		if a.kept.count == 0 || a.restarting {
			a.mu.Unlock()
			l.conn.Close()
			return false
		}
		l.sendDrain()
	}
	for old := range a.conns {
		if old.id == l.id {
			// The server replaced our old connection with this one.
			delete(a.conns, old)
			old.conn.Close()
		}
	}
	a.conns[l] = struct{}{}
	a.recountLocked()
	n, want := len(a.conns), a.maxCount
	a.connWG.Add(1)
	a.mu.Unlock()
	go func() {
		defer a.connWG.Done()
		a.serveConn(l)
	}()
	// Logged once the connection is served.
	a.log.Info("connected to server", "server_id", l.id, "addr", l.addr, "servers", fmt.Sprintf("%d/%d", n, want))
	return true
}

// takeTunnel is the link's Config.Take for a CONNECT stream on l: it
// counts the tunnel within MaxStreams and MaxStreamsTotal and returns
// serve, or a handler that answers 503 past either; nil (the link refuses
// the stream) once the drain shut the gate (tunnelGate). It runs under the
// link's lock.
func (a *Agent) takeTunnel(l *connToServer, serve http.Handler) http.Handler {
	a.gate.mu.Lock()
	if a.gate.shut {
		a.gate.mu.Unlock()
		return nil
	}
	perConn, total := l.tunnels.Add(1), a.Stats.Tunnels.Add(1)
	a.gate.mu.Unlock()
	if perConn <= int64(a.cfg.MaxStreams) && total <= int64(a.cfg.MaxStreamsTotal) {
		return serve
	}
	a.releaseTunnel(l)
	a.metrics.streamsRefused.Inc()
	why := fmt.Sprintf("%d in all (--max-streams-total; by default from the descriptor limit)", a.cfg.MaxStreamsTotal)
	if total <= int64(a.cfg.MaxStreamsTotal) {
		why = fmt.Sprintf("%d from this server (--max-streams)", a.cfg.MaxStreams)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "agent carries its most tunnels: "+why+"; try another agent", http.StatusServiceUnavailable)
	})
}

// releaseTunnel ends a tunnel's count taken by takeTunnel; the last one
// wakes a drain.
func (a *Agent) releaseTunnel(l *connToServer) {
	l.tunnels.Add(-1)
	if a.Stats.Tunnels.Add(-1) == 0 {
		a.pokeIdle()
	}
}

func (a *Agent) serveConn(l *connToServer) {
	defer close(l.done)
	control := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { a.serveControl(l, w, r) })
	pause := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { a.servePause(l, w, r) })
	tunnel := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer a.releaseTunnel(l) // counted by takeTunnel
		a.serveStream(w, r)
	})
	take := func(r *http.Request) http.Handler {
		switch {
		case r.Method == http.MethodGet && r.URL.Path == wire.ControlPath:
			return control
		case r.Method == http.MethodPost && r.URL.Path == wire.PausePath:
			return pause
		}
		return a.takeTunnel(l, tunnel)
	}
	// Handlers are counted before their goroutine starts, so Run's wait
	// for them cannot pass one that is about to begin.
	spawn := func(f func()) {
		a.linkWG.Add(1)
		go func() { defer a.linkWG.Done(); f() }()
	}
	lk, err := h2link.NewServer(l.conn, h2link.Config{
		// Room for each tunnel's own control request beside it, and the control stream.
		KeepAlive: a.cfg.KeepAlive, PingTimeout: a.cfg.PingTimeout, MaxConcurrentStreams: 2*a.cfg.MaxStreams + 1,
		Take: take, Spawn: spawn, Batch: wire.BatcherOf(l.conn),
		CreditStallAfter: a.cfg.CreditStallAfter,
		OnCreditStall: func(cs h2link.CreditStall) {
			a.metrics.creditStalls.Told(a.log, cs, "server_id", l.id, "addr", l.addr)
		},
	}, nil)
	replaced := false
	if err != nil {
		a.log.Debug("HTTP/2 set-up failed", "server_id", l.id, "addr", l.addr, "err", err)
	} else {
		l.link.Store(lk)
		lk.Serve()
		replaced = lk.PeerGoAwayDebug() == wire.GoAwayReplaced
	}
	l.conn.Close()
	if brokeOff(l.conn) {
		a.metrics.fromServerFailures.Inc()
	}
	a.mu.Lock()
	_, ours := a.conns[l] // not taken out by startConn: no login of this process replaced it
	delete(a.conns, l)
	var wait time.Duration
	if replaced && ours {
		wait = a.replacedLocked(l)
	}
	a.recountLocked()
	n, want := len(a.conns), a.maxCount
	a.mu.Unlock()
	args := []any{"server_id", l.id, "addr", l.addr, "reason", l.conn.CloseReason(), "connected_for", time.Since(l.since).Round(time.Millisecond).String(), "servers", fmt.Sprintf("%d/%d", n, want)}
	if wait > 0 {
		a.log.Warn("server connection replaced by another agent's login with this agent ID (two processes share one ID and credential: a cloned node?)", append(args, "login_in", wait.Round(time.Millisecond).String())...)
		return
	}
	a.log.Info("server connection closed", args...)
}

// replacedLocked is the agent's answer to a server that replaced l with
// another process's login of the agent's ID (wire.GoAwayReplaced): two
// processes that share an ID would otherwise replace each other as fast
// as they can log in. It sets how long the agent waits before it logs in
// again, on the reconnect back-off (SyncInterval growing to SyncCap, with
// jitter), which starts again after a connection that lasted long enough
// that the other process was not taking turns with it. The caller holds
// a.mu.
func (a *Agent) replacedLocked(l *connToServer) time.Duration {
	if time.Since(l.since) > 2*a.cfg.SyncCap {
		a.replacedWait.reset()
	}
	d := a.replacedWait.next()
	a.loginAfter = time.Now().Add(d)
	return d
}

// waitLogin waits until the agent may log in again after a replaced
// connection (replacedLocked); false once ctx ended.
func (a *Agent) waitLogin(ctx context.Context) bool {
	a.mu.Lock()
	d := time.Until(a.loginAfter)
	a.mu.Unlock()
	if d <= 0 {
		return ctx.Err() == nil
	}
	return kubeapi.Sleep(ctx, d)
}

// recountLocked adopts the largest count live servers announce (with no
// live server the last one stands), combines it with the lease count and
// wakes the seekers.
func (a *Agent) recountLocked() {
	if len(a.conns) > 0 {
		a.announced = 1
		for l := range a.conns {
			a.announced = max(a.announced, l.count)
		}
	}
	a.maxCount = a.announced
	switch {
	case a.leaseCount <= 0:
	case a.cfg.CountSource == CountLeases:
		a.maxCount = a.leaseCount
	default:
		a.maxCount = max(a.announced, a.leaseCount)
	}
	close(a.changed)
	a.changed = make(chan struct{})
}

func (a *Agent) changedChan() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.changed
}

func (a *Agent) connectedServers() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	ids := make([]string, 0, len(a.conns))
	for l := range a.conns {
		ids = append(ids, l.id)
	}
	return ids
}

// serveControl answers the server's control stream: one line per event the
// server must know about: a drain ("drain-in <duration>", when the agent
// cuts what is left, then "drain"; for a restart in place "restart-in
// <duration>" before them), and "token <token>" when the token
// file holds a new token (the server reviews it and keeps the link on it).
func (a *Agent) serveControl(l *connToServer, w http.ResponseWriter, r *http.Request) {
	w.WriteHeader(http.StatusOK)
	flush := wire.FlusherOf(w)
	flush()
	last := l.token
	var tick <-chan time.Time
	if a.cfg.Token != nil {
		t := time.NewTicker(a.cfg.TokenRefresh)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-l.drain:
			a.metrics.packets.Inc(wire.SegFromAgent, grpcwire.Drain)
			a.mu.Lock()
			left := max(time.Until(a.drainEnd), 0).Round(time.Millisecond)
			restart := a.restarting && l.agentRestart
			a.mu.Unlock()
			lines := wire.ControlDrainIn + " " + left.String() + "\n" + wire.ControlDrain + "\n"
			if restart {
				// First: the server pauses what can move before the drain
				// takes the rest.
				lines = wire.ControlRestartIn + " " + left.String() + "\n" + lines
			}
			io.WriteString(w, lines)
			flush()
			<-r.Context().Done()
			return
		case <-tick:
			token, err := a.cfg.Token()
			if err != nil {
				a.warnings.Log(a.log, slog.LevelWarn, "token refresh", "cannot read the token again; the server keeps the one it has", "err", err)
				continue
			}
			if token == last || !validToken(token) {
				continue
			}
			if _, err := io.WriteString(w, wire.ControlToken+" "+token+"\n"); err != nil {
				return
			}
			flush()
			last = token
			a.log.Debug("presented a rotated token to the server", "server_id", l.id)
		case <-r.Context().Done():
			return
		}
	}
}

// validToken accepts what can travel on one control line.
func validToken(t string) bool {
	if t == "" || len(t) > wire.MaxControlLine-len(wire.ControlToken)-2 {
		return false
	}
	for i := 0; i < len(t); i++ {
		if t[i] <= ' ' || t[i] >= 0x7f {
			return false
		}
	}
	return true
}

// headRecorder keeps the first bytes a TLS handshake reads, so that a
// plain-text refusal in their place (the server's unadmitted limit) can be
// read after the handshake failed on it. Owned by the dial until done;
// afterwards reads pass through.
type headRecorder struct {
	net.Conn
	head []byte
	done bool
}

// NetConn is the connection under the recorder: the link finds its TCP
// socket through it (h2link bounds the socket's unsent bytes).
func (h *headRecorder) NetConn() net.Conn { return h.Conn }

func (h *headRecorder) Read(p []byte) (int, error) {
	n, err := h.Conn.Read(p)
	if !h.done && len(h.head) < 512 {
		h.head = append(h.head, p[:min(n, 512-len(h.head))]...)
	}
	return n, err
}

// httpAnswer reads a plain-HTTP answer in place of a TLS handshake, or
// returns nil if err is not one. The server's unadmitted limit answers so,
// with the time to come back (Konnectivity-Retry-After-Ms): a refusal to
// retry. Any other plain-HTTP answer comes from something that is no agent
// port (a health or metrics port, an HTTP proxy): named as such.
func (h *headRecorder) httpAnswer(addr string, err error) error {
	var rh tls.RecordHeaderError
	if !errors.As(err, &rh) || string(rh.RecordHeader[:]) != "HTTP/" {
		return nil
	}
	resp, rerr := http.ReadResponse(bufio.NewReader(bytes.NewReader(h.head)), nil)
	if rerr != nil {
		return fmt.Errorf("%s answered in plain HTTP, not TLS: not a konnectivity agent port? (--proxy-server-host, --proxy-server-port)", addr)
	}
	resp.Body.Close()
	if resp.Header.Get(wire.HdrRetryAfterMs) == "" {
		return fmt.Errorf("%s answered in plain HTTP (%s), not TLS: not a konnectivity agent port? (--proxy-server-host, --proxy-server-port)", addr, resp.Status)
	}
	se := &wire.StatusError{Code: resp.StatusCode, Msg: "too many connections waiting to be admitted", RetryAfter: wire.RetryAfterHeader(resp.Header)}
	return fmt.Errorf("server %s refused the connection: %w", addr, se)
}

// backoff is capped exponential backoff with full jitter: each delay is
// drawn from the whole of [min, cur], cur doubling up to max, so agents
// that failed together do not come back together.
type backoff struct {
	min, max, cur time.Duration
}

func newBackoff(lo, hi time.Duration) *backoff { return &backoff{min: lo, max: hi, cur: lo} }

func (b *backoff) reset() { b.cur = b.min }

func (b *backoff) next() time.Duration {
	d := b.min + rand.N(b.cur-b.min+1)
	b.cur = min(b.cur*2, b.max)
	return d
}

// jitter returns a duration in [d/2, d], so a fleet of agents does not
// redial in step.
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d/2 + rand.N(d/2+1)
}

// brokeOff reports whether a server connection ended with a read error
// other than the server's clean close or this side's own close: upstream's
// Recv failure.
func brokeOff(c *wire.WatchedConn) bool {
	c.Mu.Lock()
	defer c.Mu.Unlock()
	return c.ReadErr != nil && !errors.Is(c.ReadErr, io.EOF) && !errors.Is(c.ReadErr, net.ErrClosed)
}
