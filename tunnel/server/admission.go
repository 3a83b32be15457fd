package server

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/sys/unix"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// Admission bounds what a peer on the agent port can make the server do
// before it has proved who it is, on both paths (our agents' Upgrade
// handshake and upstream agents' gRPC over h2):
//
//   - time: a connection not admitted within HeaderTimeout of its accept
//     (TLS handshake, login and review included) is closed;
//   - count: at most MaxUnadmitted such connections per server. While
//     that many are open the agent port accepts nothing: the next ones
//     wait in the kernel's listen backlog (bounded by the kernel, costing
//     this process nothing) and are accepted in arrival order as slots
//     free, so a fleet that reconnects at once is admitted as fast as the
//     handshakes run, with no refusal and no retry. Only when no slot has
//     freed for stallBound (every open connection is slow or its review
//     is stuck), or while the backlog is nearly full (past it the kernel
//     drops SYNs, which peers retry only after seconds), are waiting
//     connections accepted to be closed at once, before their TLS
//     handshake, told in one plain-text 503 when to come back
//     (wire.HdrRetryAfterMs): an agent does not wait in the backlog for most of
//     its dial timeout, nor to TCP's back-off;
//   - work: one login per connection (a refused login ends the
//     connection), and at most MaxReviews calls of AuthenticateAgent in
//     flight per server, each under the context of the connection or
//     stream that asked for it, so a peer that leaves cancels its review.
//
// A review that could not be done (apiserver unreachable, timeout) answers
// the peer "authentication unavailable"; the cause goes to the log only.

// Defaults for Config.MaxUnadmitted and MaxReviews.
const (
	defaultMaxUnadmitted = 64
	defaultMaxReviews    = 32
)

// authUnavailable is all a peer learns of a review that failed on our side.
func authUnavailable() error {
	return wire.StatusErrorf(http.StatusServiceUnavailable, "authentication unavailable")
}

// admission is the server-wide part: the unadmitted-connection count and
// the review semaphore. Its fields are set once by newAdmission.
type admission struct {
	max      int64
	open     atomic.Int64  // connections accepted and not yet admitted or closed
	freed    chan struct{} // one buffered wake-up: open went down (waitRoom)
	reviews  chan struct{} // a slot per AuthenticateAgent call in flight
	inflight atomic.Int64  // reviews holding a slot, for the gauge

	pace pacer // when a connection refused at the limit may come back

	dropped  *promtext.Counter // connections closed at once: MaxUnadmitted reached
	timedOut *promtext.Counter // connections closed at the header timeout, not admitted
	refused  *promtext.Counter // reviews that could not be done (authentication unavailable)
}

func newAdmission(m *promtext.Registry, maxUnadmitted, maxReviews int) *admission {
	a := &admission{max: int64(maxUnadmitted), reviews: make(chan struct{}, maxReviews), freed: make(chan struct{}, 1)}
	const name = serverPrefix + "unadmitted_agent_connections_closed_total"
	const help = "Agent-port connections closed before they were admitted, by reason: limit (more than --max-unadmitted-agent-connections were waiting) or timeout (not admitted within the header timeout)."
	a.dropped = m.Counter(name, help, []string{"reason"}, "limit")
	a.timedOut = m.Counter(name, help, []string{"reason"}, "timeout")
	a.refused = m.Counter(serverPrefix+"agent_authentication_unavailable_total", "Agent logins answered \"authentication unavailable\": the review could not be done (see the log for why).", nil)
	m.GaugeFunc(serverPrefix+"unadmitted_agent_connections", "Agent-port connections accepted and not yet admitted (TLS handshake, login or review under way).", nil, nil,
		func() float64 { return float64(a.open.Load()) })
	m.GaugeFunc(serverPrefix+"agent_reviews_in_flight", "Agent credential checks (TokenReview) running now.", nil, nil,
		func() float64 { return float64(a.inflight.Load()) })
	return a
}

// stallBound is how long the agent port waits for a slot to free before it
// accepts waiting connections only to refuse them: a quarter of the header
// timeout, within which every slot normally frees many times over (a
// handshake takes milliseconds), while a connection that waited that long
// in the backlog still has the rest of its dial timeout to come back.
func stallBound(headerTimeout time.Duration) time.Duration { return headerTimeout / 4 }

// hasRoom reports whether a connection accepted now would be admitted to
// wait (enter).
func (a *admission) hasRoom() bool { return a.open.Load() < a.max }

// room is what waitRoom found.
type room uint8

const (
	roomFree    room = iota // a connection accepted now is counted (enter)
	roomFull                // no slot, and the listen backlog is nearly full
	roomStalled             // no slot freed for the stall bound
	roomClosing             // the server is shutting down
)

// backlogPoll is how often waitRoom reads the listen backlog's length.
const backlogPoll = 10 * time.Millisecond

// waitRoom waits until hasRoom, ctx ends, no slot freed for bound, or
// full reports the listen backlog nearly full (nil: not known). The agent
// port's accept loop calls it before each accept, so connections past the
// limit stay in the backlog, unless it would overflow: the kernel would
// then drop their SYNs, and the peers' TCP would retry at 1, 3, 7 and 15 s,
// slower than a refusal saying when to come back.
func (a *admission) waitRoom(ctx context.Context, bound time.Duration, full func() bool) room {
	if a.hasRoom() {
		return roomFree
	}
	if full != nil && full() {
		return roomFull
	}
	t := time.NewTimer(bound)
	defer t.Stop()
	var poll <-chan time.Time
	if full != nil {
		tk := time.NewTicker(backlogPoll)
		defer tk.Stop()
		poll = tk.C
	}
	for !a.hasRoom() {
		select {
		case <-a.freed:
		case <-poll:
			if full() {
				return roomFull
			}
		case <-t.C:
			if a.hasRoom() {
				return roomFree
			}
			return roomStalled
		case <-ctx.Done():
			return roomClosing
		}
	}
	return roomFree
}

// backlogOf returns a function that reads ln's listen backlog: the
// connections waiting to be accepted and how many it may hold (TCP_INFO of
// a listening socket), or nil when ln does not say.
func backlogOf(ln net.Listener) func() (queued, limit int) {
	sc, ok := ln.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return func() (int, int) {
		var info *unix.TCPInfo
		var err error
		if cerr := rc.Control(func(fd uintptr) { info, err = unix.GetsockoptTCPInfo(int(fd), unix.SOL_TCP, unix.TCP_INFO) }); cerr != nil || err != nil {
			return 0, 0
		}
		return int(info.Unacked), int(info.Sacked)
	}
}

// nearlyFullAt is the length at which a backlog that may hold limit is
// nearly full: all but a sixteenth (at least one), which is room for
// the connections that arrive between two readings (backlogPoll) of a
// fleet connecting at once, while refusing none that the backlog can hold.
func nearlyFullAt(limit int) int { return limit - max(limit/16, 1) }

// nearlyFull reports whether a backlog is nearly full.
func nearlyFull(queued, limit int) bool { return limit > 0 && queued >= nearlyFullAt(limit) }

// leave stops counting a connection and wakes waitRoom.
func (a *admission) leave() {
	a.open.Add(-1)
	select {
	case a.freed <- struct{}{}:
	default:
	}
}

// pacer spaces the retries of connections refused at the unadmitted limit.
// While slots move, one frees about every slotTime/max (slotTime: how
// long an admitted connection waited, a moving average; max connections
// wait at once), and with it a place in the listen backlog.
//
// A refusal at a nearly full backlog needs a place in the backlog, not
// its turn: whenever it comes back it queues at the tail. So the refused
// are given moments one slot's time apart from now (roomAfter), the rate
// at which places free: none comes back to a backlog still full (to be
// refused again), and none is turned away while the server has nothing left
// to admit. An estimate taken early in a fleet's reconnect errs slow
// (the peers' own handshakes compete for CPU then), which only spaces
// them a little wider.
//
// A refusal because the slots stalled (every waiting connection is slow)
// is given moments half a slot's time apart, after half the time the
// connections queued ahead of it take to be admitted, but no later than
// ahead (a quarter of the header timeout): the rate that estimate rests
// on is stale, and a refused agent that comes back too early waits in the
// backlog, while one that comes back too late lets the server idle
// (retryAfter). A leaf lock.
type pacer struct {
	mu       sync.Mutex
	slotTime time.Duration // guarded by mu: moving average, accept to admission
	next     time.Time     // guarded by mu: the last moment given out
}

// admitted records how long an admitted connection waited.
func (p *pacer) admitted(waited time.Duration) {
	p.mu.Lock()
	if p.slotTime == 0 {
		p.slotTime = waited
	} else {
		p.slotTime += (waited - p.slotTime) / 8
	}
	p.mu.Unlock()
}

// roomAfter gives a connection refused at a nearly full backlog the next
// moment to come back: one slot's time after the last one given out.
func (p *pacer) roomAfter(now time.Time, slots int64) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.giveLocked(now, p.slotTimeLocked()/time.Duration(max(slots, 1)), 0)
}

// slotTimeLocked is slotTime, or a handshake's worth before anything was
// admitted.
func (p *pacer) slotTimeLocked() time.Duration {
	if p.slotTime == 0 {
		return 100 * time.Millisecond
	}
	return p.slotTime
}

// giveLocked gives the moment step after the later of the last one and
// now+lead, within the bounds.
func (p *pacer) giveLocked(now time.Time, step, lead time.Duration) time.Duration {
	p.next = maxTime(p.next, now.Add(lead)).Add(step)
	if d := p.next.Sub(now); d > wire.MaxRetryAfter {
		p.next = now.Add(wire.MaxRetryAfter)
	}
	return min(max(p.next.Sub(now), wire.MinRetryAfter), wire.MaxRetryAfter)
}

// retryAfter gives a connection refused because the slots stalled the
// next moment to come back, with queued connections waiting in the listen
// backlog ahead of it, whom it waits for at most ahead.
func (p *pacer) retryAfter(now time.Time, slots int64, queued int, ahead time.Duration) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	step := p.slotTimeLocked() / time.Duration(2*max(slots, 1))
	return p.giveLocked(now, step, min(time.Duration(queued)*step, ahead))
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// refuseBusy answers a connection refused at the unadmitted limit with a
// plain-text 503 saying when to come back, and closes it. The answer is
// one small write on a fresh socket, so it never waits on the peer.
func refuseBusy(conn net.Conn, retry time.Duration) {
	conn.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	fmt.Fprintf(conn, "HTTP/1.1 503 Service Unavailable\r\n%s: %d\r\nRetry-After: %d\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
		wire.HdrRetryAfterMs, retry.Milliseconds(), int64((retry+time.Second-1)/time.Second))
	conn.Close()
}

// pendingConn is one agent-port connection from its accept until it is
// admitted or closed. The deadline timer closes the connection unless
// admit wins the race for mu first.
type pendingConn struct {
	a     *admission
	conn  net.Conn
	timer *time.Timer
	start time.Time // its accept

	mu       sync.Mutex
	state    pendingState // guarded by mu
	loggedIn bool         // guarded by mu: a login was started on this connection
}

type pendingState uint8

const (
	pendingWaiting  pendingState = iota // counted; the timer is armed
	pendingAdmitted                     // admitted: no longer counted, timer stopped
	pendingEnded                        // closed unadmitted (timeout or release): no longer counted
)

// enter counts a newly accepted connection and arms its deadline. It
// returns nil when MaxUnadmitted are already waiting: the caller refuses
// conn (refuseBusy).
func (a *admission) enter(conn net.Conn, timeout time.Duration) *pendingConn {
	if a.open.Add(1) > a.max {
		a.open.Add(-1)
		a.dropped.Inc()
		return nil
	}
	p := &pendingConn{a: a, conn: conn, start: time.Now()}
	p.mu.Lock()
	p.timer = time.AfterFunc(timeout, p.expire)
	p.mu.Unlock()
	return p
}

// expire runs on the timer's goroutine: a connection still waiting is closed.
func (p *pendingConn) expire() {
	p.mu.Lock()
	if p.state != pendingWaiting {
		p.mu.Unlock()
		return
	}
	p.state = pendingEnded
	p.mu.Unlock()
	p.a.leave()
	p.a.timedOut.Inc()
	p.conn.Close()
}

// admit marks the connection admitted: it stops counting and its deadline
// is lifted. False means the deadline passed first and the connection is
// closed.
func (p *pendingConn) admit() bool {
	p.mu.Lock()
	if p.state != pendingWaiting {
		ok := p.state == pendingAdmitted
		p.mu.Unlock()
		return ok
	}
	p.state = pendingAdmitted
	p.mu.Unlock()
	p.timer.Stop()
	p.a.leave()
	p.a.pace.admitted(time.Since(p.start))
	return true
}

// release stops counting a connection that ends without being admitted
// (the caller closes it); a no-op after admit or expire.
func (p *pendingConn) release() {
	p.mu.Lock()
	if p.state != pendingWaiting {
		p.mu.Unlock()
		return
	}
	p.state = pendingEnded
	p.mu.Unlock()
	p.timer.Stop()
	p.a.leave()
}

// beginLogin reports whether this is the connection's first login. A
// connection gets one: while it runs no other may start, and once refused
// the connection is ended.
func (p *pendingConn) beginLogin() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.loggedIn || p.state != pendingWaiting {
		return false
	}
	p.loggedIn = true
	return true
}

// review runs check (authentication, then the identity checks) with one
// of the server's review slots, under ctx (the connection's or the
// stream's: a peer that leaves frees its slot and cancels its review). A
// failure on our side (anything but a refusal below 500 the checks chose)
// is logged with its cause and becomes authUnavailable.
func (s *Server) review(ctx context.Context, agentID, remote string, check func(context.Context) error) error {
	a := s.gate
	select {
	case a.reviews <- struct{}{}:
	case <-ctx.Done():
		return authUnavailable()
	}
	a.inflight.Add(1)
	err := check(ctx)
	a.inflight.Add(-1)
	<-a.reviews
	if err == nil {
		return nil
	}
	var se *wire.StatusError
	if errors.As(err, &se) && se.Code < 500 {
		return err
	}
	if ctx.Err() != nil {
		// The peer left, or its time was up: nobody to tell.
		s.log.Debug("agent review abandoned", "agent", agentID, "remote", remote, "err", wire.ErrMsg(err))
		return authUnavailable()
	}
	a.refused.Inc()
	s.warnings.Log(s.log, slog.LevelWarn, "review unavailable", "agent authentication unavailable", "agent", agentID, "remote", remote, "err", wire.ErrMsg(err))
	return authUnavailable()
}

// watchHangup cancels cancel if the peer closes conn while its login is
// reviewed, so a peer that leaves takes its review with it. Our agents
// send nothing between their handshake and the answer, so a byte that
// arrives meanwhile also ends the login. stop ends the watch (the caller
// sets the read deadline again afterwards) and reports whether the peer
// is still there and silent; it must be called once.
func watchHangup(conn net.Conn, cancel context.CancelFunc) (stop func() bool) {
	ended := make(chan error, 1)
	go func() { // owned by the caller: stop waits for it
		var b [1]byte
		_, err := conn.Read(b[:])
		if err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
			cancel()
		}
		ended <- err
	}()
	return func() bool {
		conn.SetReadDeadline(time.Unix(1, 0)) // wakes the read
		err := <-ended
		return err != nil && errors.Is(err, os.ErrDeadlineExceeded)
	}
}

// refuseUnadmitted answers a connection accepted past the unadmitted
// limit (its slots stalled, or the listen backlog nearly full, with queued
// connections in it) with when to come back (pacer), and closes it.
func (s *Server) refuseUnadmitted(raw net.Conn, queued int, stalled bool) {
	s.Stats.AgentsRefused.Add(1)
	var retry time.Duration
	if stalled {
		retry = s.gate.pace.retryAfter(time.Now(), s.gate.max, queued, stallBound(s.cfg.HeaderTimeout))
	} else {
		retry = s.gate.pace.roomAfter(time.Now(), s.gate.max)
	}
	refuseBusy(raw, retry)
	reason := "listen backlog nearly full"
	if stalled {
		reason = "no slot freed"
	}
	s.warnings.Log(s.log, slog.LevelWarn, "unadmitted limit", "agent connection closed: too many connections waiting to be admitted", "remote", raw.RemoteAddr().String(), "limit", s.cfg.MaxUnadmitted, "backlog", queued, "reason", reason, "retry_in", retry.Round(time.Millisecond).String())
}

// serveAgentConn runs one agent connection: TLS, the Upgrade handshake, then
// HTTP/2 with this server as the client, until the connection ends. pc is
// its admission (enter).
func (s *Server) serveAgentConn(raw net.Conn, pc *pendingConn) {
	remote := raw.RemoteAddr().String()
	defer pc.release()
	deadline := time.Now().Add(s.cfg.HeaderTimeout)
	raw.SetDeadline(deadline)
	tc := wire.TlsServer(raw, s.cfg.AgentTLS)
	ctx, cancel := context.WithDeadline(s.baseCtx, deadline)
	err := tc.HandshakeContext(ctx)
	cancel()
	if err != nil {
		s.Stats.AgentsRefused.Add(1)
		raw.Close()
		// Debug: load-balancer health checks look exactly like this.
		s.log.Debug("agent TLS handshake failed", "remote", remote, "err", err)
		return
	}
	tlsState := tc.ConnectionState()
	var conn net.Conn = tc
	lim := &wire.HeadLimiter{R: conn, Remaining: wire.MaxHandshakeHead, Limited: true}
	br := bufio.NewReaderSize(lim, 4096)
	if speaksGRPC(tlsState, br) {
		// Upstream's agent: gRPC AgentService/Connect on the same port.
		lim.Limited = false
		raw.SetDeadline(time.Time{})
		var up net.Conn = conn
		if br.Buffered() > 0 {
			up = &wire.BufferedConn{Conn: conn, R: br}
		}
		s.serveUpstreamAgent(up, tlsState, remote, pc)
		return
	}
	hello, err := wire.ReadHello(br)
	var principal Principal
	var ids wire.Identifiers
	if err == nil {
		ctx, cancel := context.WithDeadline(s.baseCtx, deadline)
		stop := watchHangup(conn, cancel)
		principal, ids, err = s.admit(ctx, &hello, tlsState, remote)
		if !stop() && err == nil {
			err = wire.StatusErrorf(http.StatusBadRequest, "the agent hung up or sent data before the handshake answer")
		}
		cancel()
		conn.SetReadDeadline(deadline)
	}
	if err != nil {
		s.refuseAgent(conn, hello.ID, remote, err)
		return
	}
	if !pc.admit() {
		conn.Close() // the header timeout came first
		return
	}
	lim.Limited = false
	conn.SetDeadline(time.Time{})

	s.startAgentLink(conn, br, hello, principal, ids, tlsState, remote)
}

// refuseAgent answers a handshake that failed with its status and closes
// the connection, then logs it as what it most likely was.
func (s *Server) refuseAgent(conn net.Conn, id, remote string, err error) {
	code := wire.StatusCode(err)
	conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
	wire.WriteStatus(conn, code, wire.ErrMsg(err))
	conn.Close()
	switch {
	case code == http.StatusConflict: // a duplicate: expected while agents seek every server
	case id == "":
		// Not an agent at all (a probe, a port scan): count it, log at debug.
		s.Stats.AgentsRefused.Add(1)
		s.log.Debug("not an agent handshake", "remote", remote, "status", code, "reason", wire.ErrMsg(err))
	default:
		s.Stats.AgentsRefused.Add(1)
		s.logRefusal(id, remote, err, "status", code)
	}
}

// logRefusal logs a refused login at WARN, one line per source and reason
// per interval (with the count of those suppressed), so a reconnect storm
// yields a few lines and a second, different reason from the same source
// is still seen.
func (s *Server) logRefusal(id, remote string, err error, args ...any) {
	reason := wire.ErrMsg(err)
	key := reason
	if se, ok := errors.AsType[*wire.StatusError](err); ok && se.Reason != "" {
		key = se.Reason
	}
	if len(key) > 96 {
		key = key[:96]
	}
	s.warnings.Log(s.log, slog.LevelWarn, "refused "+hostOf(remote)+" "+key, "agent refused", append([]any{"agent", id, "remote", remote, "reason", reason}, args...)...)
}

// startAgentLink answers an admitted agent's handshake, which br read,
// runs HTTP/2 as the client on its connection and registers the agent.
// The answer, the HTTP/2 preface and settings leave in one system call:
// a fleet reconnecting at once costs the server a write per agent, not
// four.
func (s *Server) startAgentLink(conn net.Conn, br *bufio.Reader, hello wire.AgentHello, principal Principal, ids wire.Identifiers, tlsState tls.ConnectionState, remote string) {
	// The agent sends nothing more until it has read the 101, so the
	// handshake's buffer is normally empty and can be let go.
	var h2conn net.Conn = conn
	if br.Buffered() > 0 {
		h2conn = &wire.BufferedConn{Conn: conn, R: br}
	}
	wc := wire.NewWatchedConn(h2conn)
	link, err := h2link.NewClient(wc, h2link.Config{KeepAlive: s.cfg.KeepAlive, PingTimeout: s.cfg.PingTimeout, Spawn: s.goroutine, Batch: wire.BatcherOf(wc), Queued: &s.queued, Prelude: wire.Switching(s.cfg.ID, s.cfg.Count),
		CreditStallAfter: s.cfg.CreditStallAfter,
		OnCreditStall: func(cs h2link.CreditStall) {
			s.metrics.creditStalls.Told(s.log, cs, "agent", hello.ID, "remote", remote)
		},
	})
	if err != nil {
		s.log.Info("agent HTTP/2 setup failed", "agent", hello.ID, "remote", remote, "err", err)
		wc.Close()
		return
	}
	ctlCtx, stopControl := context.WithCancel(s.baseCtx)
	a := &agentConn{id: hello.ID, claimedID: hello.Claimed, ids: ids, remote: remote, since: time.Now(), opener: linkOpener{link}, conn: wc, stopControl: stopControl, principal: principal, canPause: hello.CanPause, node: s.boundNode(principal, hello.ID), credKey: credKey(principal, remote)}
	if err := s.register(a, hello.Token, tlsState); err != nil {
		stopControl()
		a.endCredential()
		link.Close()
		s.log.Info("agent refused: "+err.Error(), "agent", a.id, "remote", remote)
		return
	}
	// No goroutine waits for the connection to end (an idle agent costs
	// what it holds, not a parked stack): closing it unregisters the agent.
	// The agent is served before its line is logged.
	wc.OnClose(func() {
		stopControl()
		a.endCredential()
		s.agents.remove(a)
		if !a.quiet.Load() {
			s.log.Info("agent disconnected", "agent", a.id, "remote", remote, "reason", wc.CloseReason(), "connected_for", time.Since(a.since).Round(time.Millisecond).String(), "agents", s.agents.len())
		}
	})
	s.goroutine(func() { s.watchControl(ctlCtx, a, link) })
	if !a.quiet.Load() {
		s.log.Info("agent connected", append(a.claimedAttr(), "remote", remote, "identifiers", hello.Identifiers, "routed_by", ids.String(), "agents", s.agents.len())...)
	}
}

// admit runs the cheap checks first and authentication last, so a duplicate
// connection costs no token review; then it checks that the credential
// backs the agent's ID and identifiers (identity.go). ctx bounds both,
// under one review slot (admission.go): the connection's deadline, or the
// login stream's life. It returns the identifiers to register the agent
// with: those the credential backs.
func (s *Server) admit(ctx context.Context, h *wire.AgentHello, tlsState tls.ConnectionState, remote string) (Principal, wire.Identifiers, error) {
	if slices.Contains(h.Connected, s.cfg.ID) {
		return Principal{}, wire.Identifiers{}, wire.StatusErrorf(http.StatusConflict, "agent already holds a connection to server %s", s.cfg.ID)
	}
	if s.isShutting() {
		return Principal{}, wire.Identifiers{}, wire.StatusErrorf(http.StatusServiceUnavailable, "server is shutting down")
	}
	ids, err := wire.ParseFromAgent(h.Identifiers)
	if err != nil {
		return Principal{}, wire.Identifiers{}, wire.StatusErrorf(http.StatusBadRequest, "%v", err)
	}
	var p Principal
	err = s.review(ctx, h.ID, remote, func(ctx context.Context) error {
		var err error
		if p, err = s.authenticate(ctx, AgentCredentials{AgentID: h.ID, Token: h.Token, TLS: tlsState}); err != nil {
			return err
		}
		var id string
		id, ids, err = s.checkIdentity(ctx, p, h.ID, ids)
		if err == nil && id != h.ID {
			h.ID, h.Claimed = id, h.ID
		}
		return err
	})
	if err != nil {
		return Principal{}, wire.Identifiers{}, err
	}
	if open, ok := s.agents.credRoom(credKey(p, remote), h.ID, s.cfg.MaxAgentsPerCredential); !ok {
		s.metrics.agentsRefusedCred.Inc()
		return Principal{}, wire.Identifiers{}, credBoundError(open, remote)
	}
	return p, ids, nil
}

// watchControl reads the control stream of a, our agent on link: one
// line per event.
func (s *Server) watchControl(ctx context.Context, a *agentConn, link *h2link.Conn) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://agent"+wire.ControlPath, nil)
	if err != nil {
		return
	}
	resp, err := link.RoundTrip(req)
	if err != nil {
		return
	}
	w := &controlWatch{s: s, a: a, body: resp.Body, cutIn: agentDrainAssumed}
	w.run()
}

// controlWatch reads an agent's control stream. Between lines it holds no
// goroutine and no buffer: this sits idle on every agent connection, and
// an idle agent costs what it holds, not a parked stack. One goroutine at
// a time owns it: the one watchControl runs on, then each one the body's
// Notify starts when bytes come.
type controlWatch struct {
	s     *Server
	a     *agentConn
	body  io.ReadCloser
	line  []byte        // a line begun and not ended, at most wire.MaxControlLine
	cutIn time.Duration // when the agent says it cuts what is left of a drain
}

// run reads what the stream holds, acts on each whole line, and returns
// once a read would block (Notify starts it again) or the stream ended.
func (w *controlWatch) run() {
	for {
		if b, ok := w.body.(*h2link.Body); ok && !b.Notify(func() { w.s.goroutineIfOpen(w.run) }) {
			return
		}
		buf := make([]byte, 512)
		n, err := w.body.Read(buf)
		if err == nil {
			err = w.take(buf[:n], func(line string) { w.s.controlLine(w.a, line, &w.cutIn) })
		}
		if err != nil {
			w.body.Close()
			return
		}
	}
}

// take passes each line p ends to each, trimmed; it keeps the start of
// one it does not end.
func (w *controlWatch) take(p []byte, each func(line string)) error {
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		end := i + 1
		if i < 0 {
			end = len(p)
		}
		if len(w.line)+end > wire.MaxControlLine {
			return errors.New("control line too long")
		}
		w.line = append(w.line, p[:end]...)
		p = p[end:]
		if i >= 0 {
			line := string(w.line)
			w.line = w.line[:0]
			each(strings.TrimSpace(line))
		}
	}
	if len(w.line) == 0 {
		w.line = nil // no buffer while the agent is quiet
	}
	return nil
}

// controlLine acts on one line of an agent's control stream.
func (s *Server) controlLine(a *agentConn, line string, cutIn *time.Duration) {
	if token, ok := strings.CutPrefix(line, wire.ControlToken+" "); ok {
		s.newToken(a, strings.TrimSpace(token))
		return
	}
	if _, ok := strings.CutPrefix(line, wire.ControlRestartIn+" "); ok {
		s.hand.agentRestarting(a)
		return
	}
	if v, ok := strings.CutPrefix(line, wire.ControlDrainIn+" "); ok {
		if d, err := time.ParseDuration(v); err == nil && d >= 0 && d <= wire.MaxDrainIn {
			*cutIn = d
		}
		return
	}
	if line == wire.ControlDrain {
		s.metrics.packets.Inc(wire.SegFromAgent, grpcwire.Drain)
		s.log.Info("agent draining: new dials prefer other agents; its idle tunnels close at quiet moments", "agent", a.id, "remote", a.remote)
		s.agentDraining(a, *cutIn)
	}
}

// register puts an admitted agent, ours or an upstream one, in the registry:
// it watches the credential the agent logged in with and claims the agent's
// ID. An agent that reconnected replaces its old connection, which may be
// half-dead: the old one is drained (its tunnels may finish, new dials go
// to the new one) within the keepalive and PING timeouts. It returns an
// error, registering nothing, when another credential took the ID during
// the login (errIDTaken), logins racing with it took the last room its
// credential has (errCredBound), or the server began shutting down
// meanwhile (errAgentLate); the caller then ends the credential watch and
// the connection.
//
// The shutting check and the claim are one step under Server.mu: Shutdown
// and Close set shutting under it and then find the agents to close in
// the registry, so an agent claimed after that would be closed by no one,
// and its link would delay Close (and a restart) until the agent left.
var (
	errIDTaken   = errors.New("its ID was taken by another credential during the login")
	errAgentLate = errors.New("the server began shutting down during the login")
	errCredBound = errors.New("the credential holds as many agent connections from its address as --max-agent-connections-per-credential allows")
)

// credBoundError refuses a login over Config.MaxAgentsPerCredential (429). The
// login checks the bound early, before the link is set up; the claim
// checks it again under the registry's lock, so that logins racing past
// the early check cannot add up to more than the bound.
func credBoundError(open int, remote string) *wire.StatusError {
	return wire.StatusErrorf(http.StatusTooManyRequests, "this credential already holds %d agent connections from %s, the bound per credential and address (--max-agent-connections-per-credential)", open, hostOf(remote))
}

func (s *Server) register(a *agentConn, token string, tlsState tls.ConnectionState) error {
	s.watchCredential(a, token, tlsState)
	s.mu.Lock()
	if s.shutting {
		s.mu.Unlock()
		return errAgentLate
	}
	old, err := s.agents.claim(a, s.cfg.MaxAgentsPerCredential)
	s.mu.Unlock()
	if err != nil {
		if err == errCredBound {
			s.metrics.agentsRefusedCred.Inc()
		}
		return err
	}
	if old != nil {
		// A connection that announced a drain or a restart expects its
		// successor; any other was replaced (replaced.go).
		announced := old.draining.Swap(true) || old.restarting.Load()
		if !announced {
			s.noteReplaced(a, old)
		}
		s.goroutine(func() {
			if l := old.ourLink(); l != nil && !announced {
				// Said before the drain, so the agent learns why: its
				// GOAWAY write waits for no one but that agent.
				l.SetGoAwayDebug(wire.GoAwayReplaced)
				l.GoAwayNow()
			}
			ctx, cancel := context.WithTimeout(s.baseCtx, s.cfg.KeepAlive+s.cfg.PingTimeout)
			defer cancel()
			old.shutdown(ctx)
		})
	}
	return nil
}

// noteReplaced counts a's login replacing old, a connection of its ID that
// announced no drain or restart; in a run (replaced.go) neither's line is
// logged, and the run is reported when due.
func (s *Server) noteReplaced(a, old *agentConn) {
	rep := s.replaced.note(a.id, time.Now())
	if !rep.inRun {
		return
	}
	a.quiet.Store(true)
	old.quiet.Store(true)
	if rep.report {
		s.log.Warn("agent ID replaced over and over: two agent processes share this ID and credential (a cloned node?); each one replaced waits before it logs in again", "agent", a.id, "replaced", rep.count, "run_for", rep.runFor.Round(time.Millisecond).String())
	}
}

// speaksGRPC tells upstream's gRPC agents from ours on the agent port.
// ALPN decides where it says: h2 is upstream's agent. A protocol from the
// server's --alpn-proto list (a port routed by ALPN) or none says nothing,
// so the first bytes decide: the HTTP/2 client preface is upstream's agent,
// anything else is read as our Upgrade request. The peek runs under the
// handshake's deadline and head bound.
func speaksGRPC(tlsState tls.ConnectionState, br *bufio.Reader) bool {
	if tlsState.NegotiatedProtocol == "h2" {
		return true
	}
	first, _ := br.Peek(len(http2Preface))
	return string(first) == http2Preface
}

// http2Preface is the start of the HTTP/2 client connection preface; no
// HTTP/1.1 request line begins with it.
const http2Preface = "PRI * HTTP/2.0"
