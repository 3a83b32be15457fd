package tunnel

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/promtext"
)

// Admission bounds what a peer on the agent port can make the server do
// before it has proved who it is, on both paths (our agents' Upgrade
// handshake and upstream agents' gRPC over h2):
//
//   - time: a connection not admitted within HeaderTimeout of its accept
//     (TLS handshake, login and review included) is closed;
//   - count: at most MaxUnadmitted such connections per server; past it a
//     new connection is closed at once, before its TLS handshake;
//   - work: one login per connection (a refused login ends the
//     connection), and at most MaxReviews calls of AuthenticateAgent in
//     flight per server, each under the context of the connection or
//     stream that asked for it, so a peer that leaves cancels its review.
//
// A review that could not be done (apiserver unreachable, timeout) answers
// the peer "authentication unavailable"; the cause goes to the log only.

// Defaults for ServerConfig.MaxUnadmitted and MaxReviews.
const (
	defaultMaxUnadmitted = 64
	defaultMaxReviews    = 32
)

// authUnavailable is all a peer learns of a review that failed on our side.
func authUnavailable() error {
	return statusErrorf(http.StatusServiceUnavailable, "authentication unavailable")
}

// admission is the server-wide part: the unadmitted-connection count and
// the review semaphore. Its fields are set once by newAdmission.
type admission struct {
	max      int64
	open     atomic.Int64  // connections accepted and not yet admitted or closed
	reviews  chan struct{} // a slot per AuthenticateAgent call in flight
	inflight atomic.Int64  // reviews holding a slot, for the gauge

	dropped  *promtext.Counter // connections closed at once: MaxUnadmitted reached
	timedOut *promtext.Counter // connections closed at the header timeout, not admitted
	refused  *promtext.Counter // reviews that could not be done (authentication unavailable)
}

func newAdmission(m *promtext.Registry, maxUnadmitted, maxReviews int) *admission {
	a := &admission{max: int64(maxUnadmitted), reviews: make(chan struct{}, maxReviews)}
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

// pendingConn is one agent-port connection from its accept until it is
// admitted or closed. The deadline timer closes the connection unless
// admit wins the race for mu first.
type pendingConn struct {
	a     *admission
	conn  net.Conn
	timer *time.Timer

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
// returns nil, having closed conn, when MaxUnadmitted are already waiting.
func (a *admission) enter(conn net.Conn, timeout time.Duration) *pendingConn {
	if a.open.Add(1) > a.max {
		a.open.Add(-1)
		a.dropped.Inc()
		conn.Close()
		return nil
	}
	p := &pendingConn{a: a, conn: conn}
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
	p.a.open.Add(-1)
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
	p.a.open.Add(-1)
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
	p.a.open.Add(-1)
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
	var se *StatusError
	if errors.As(err, &se) && se.Code < 500 {
		return err
	}
	if ctx.Err() != nil {
		// The peer left, or its time was up: nobody to tell.
		s.log.Debug("agent review abandoned", "agent", agentID, "remote", remote, "err", errMsg(err))
		return authUnavailable()
	}
	a.refused.Inc()
	s.quiet.log(s.log, slog.LevelWarn, "review unavailable", "agent authentication unavailable", "agent", agentID, "remote", remote, "err", errMsg(err))
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

// register puts an admitted agent, ours or an upstream one, in the registry:
// it watches the credential the agent logged in with and claims the agent's
// ID. An agent that reconnected replaces its old connection, which may be
// half-dead: the old one is drained (its tunnels may finish, new dials go
// to the new one) within the keepalive and PING timeouts. It returns false,
// registering nothing, when another credential took the ID during the
// login; the caller then ends the credential watch and the connection.
func (s *Server) register(a *agentConn, token string, tlsState tls.ConnectionState) bool {
	s.watchCredential(a, token, tlsState)
	old, ok := s.agents.claim(a)
	if !ok {
		return false
	}
	if old != nil {
		old.draining.Store(true)
		s.goroutine(func() {
			ctx, cancel := context.WithTimeout(s.baseCtx, s.cfg.KeepAlive+s.cfg.PingTimeout)
			defer cancel()
			old.shutdown(ctx)
		})
	}
	return true
}
