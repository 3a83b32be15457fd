package tunnel

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
	"github.com/spinifex/konnectivity/tunnel/promtext"
	"golang.org/x/sys/unix"
)

// AgentCredentials is what an agent presented when it connected.
type AgentCredentials struct {
	AgentID string
	Token   string // bearer token, empty if none; never log it
	TLS     tls.ConnectionState
}

// ServerConfig configures a Server. Zero durations take the defaults below.
type ServerConfig struct {
	ID    string // announced to agents; required
	Count int    // how many server replicas agents should reach

	// AgentTLS is used for the agent listener. It should verify client
	// certificates if mTLS is wanted (VerifyClientCertIfGiven lets token
	// agents in too). Nil means plain TCP, for tests only.
	AgentTLS *tls.Config
	// AuthenticateAgent decides whether an agent may connect. It runs after
	// cheap checks (duplicate server, malformed hello); a *StatusError sets
	// the status the agent sees. Nil admits every agent.
	AuthenticateAgent func(ctx context.Context, c AgentCredentials) error
	// IdentifyAgent, when set, is used instead of AuthenticateAgent: it
	// also says what the credential proves, which Identity binds the
	// agent's ID and identifiers to.
	IdentifyAgent func(ctx context.Context, c AgentCredentials) (Principal, error)
	// Identity says what an agent may claim given its Principal.
	Identity IdentityPolicy
	// CheckFrontendPeer may refuse a frontend connection (403) before its
	// request is read, for example by the peer's Unix credentials.
	CheckFrontendPeer func(net.Conn) error

	Strategies         []Strategy
	AgentWait          time.Duration // how long a dial waits for an agent to appear (default 5s)
	DialTimeout        time.Duration // bound from CONNECT to the agent's answer (default 10s)
	HeaderTimeout      time.Duration // bound on reading a request head or handshake (default 10s)
	KeepAlive          time.Duration // idle time before an HTTP/2 PING (default 30s)
	PingTimeout        time.Duration // how long a PING may go unanswered (default 15s)
	MaxStreamsPerAgent int           // open tunnels per agent before it is skipped (default 10000)
	// MaxUnadmitted bounds the agent-port connections accepted and not yet
	// admitted (default 64); MaxReviews the AuthenticateAgent calls in
	// flight (default 32). See admission.go.
	MaxUnadmitted int
	MaxReviews    int

	// Metrics receives the server's metrics; nil makes a private registry.
	Metrics *promtext.Registry

	Logger *slog.Logger
}

func (c *ServerConfig) setDefaults() {
	defaultDuration(&c.AgentWait, 5*time.Second)
	defaultDuration(&c.DialTimeout, 10*time.Second)
	defaultDuration(&c.HeaderTimeout, 10*time.Second)
	defaultDuration(&c.KeepAlive, 30*time.Second)
	defaultDuration(&c.PingTimeout, 15*time.Second)
	if c.MaxStreamsPerAgent <= 0 {
		c.MaxStreamsPerAgent = 10000
	}
	if c.Count < 1 {
		c.Count = 1
	}
	if c.MaxUnadmitted <= 0 {
		c.MaxUnadmitted = defaultMaxUnadmitted
	}
	if c.MaxReviews <= 0 {
		c.MaxReviews = defaultMaxReviews
	}
	if len(c.Strategies) == 0 {
		c.Strategies = []Strategy{StrategyDefault}
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Metrics == nil {
		c.Metrics = promtext.NewRegistry()
	}
}

// Server accepts agents on one side and CONNECT requests on the other, and
// joins each request to an HTTP/2 stream on an agent's connection.
type Server struct {
	cfg    ServerConfig
	log    *slog.Logger
	agents *registry

	// baseCtx is cancelled by Close, ending every tunnel and handshake.
	baseCtx   context.Context
	cancelAll context.CancelFunc

	mu        sync.Mutex
	listeners map[*net.Listener]struct{}
	frontends map[net.Conn]struct{}
	shutting  bool           // no new connections are accepted
	closed    bool           // everything is being torn down
	wg        sync.WaitGroup // every goroutine the server starts

	acceptLoops sync.WaitGroup
	pending     atomic.Int64 // accepted frontend connections whose dial is not yet answered

	Stats         ServerStats
	metrics       *serverMetrics
	gate          *admission // agent-port connections before they are admitted
	identity      *identityState
	quiet         *logLimiter  // repeated warnings: one line per key per 10s
	hangups       hangups      // open Unix-socket tunnels, swept for clients that left
	spareFD       *os.File     // released to answer 503 when out of file descriptors
	nextConnectID atomic.Int64 // gRPC frontend connection IDs
}

// ServerStats are counters an operator reads through metrics and status.
type ServerStats struct {
	DialsOK, DialsFailed, FrontendOpen, AgentsRefused atomic.Int64
	BytesToAgent, BytesFromAgent                      atomic.Int64
}

// NewServer checks cfg and returns a Server that is not yet serving.
func NewServer(cfg ServerConfig) (*Server, error) {
	cfg.setDefaults()
	if err := validID(cfg.ID); err != nil {
		return nil, fmt.Errorf("server %w", err)
	}
	if cfg.AgentTLS != nil {
		cfg.AgentTLS = withH2(cfg.AgentTLS)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{
		cfg:       cfg,
		log:       cfg.Logger,
		agents:    newRegistry(),
		baseCtx:   ctx,
		cancelAll: cancel,
		listeners: make(map[*net.Listener]struct{}),
		frontends: make(map[net.Conn]struct{}),
	}
	s.metrics = newServerMetrics(cfg.Metrics, s)
	s.gate = newAdmission(cfg.Metrics, cfg.MaxUnadmitted, cfg.MaxReviews)
	s.identity = newIdentityState(cfg.Metrics)
	s.quiet = newLogLimiter(10 * time.Second)
	s.hangups.tunnels = map[net.Conn]*hangupEntry{}
	s.spareFD, _ = os.Open(os.DevNull)
	s.goroutine(s.runHangups)
	return s, nil
}

// withH2 offers ALPN h2 on the agent port: upstream agents negotiate it and
// speak gRPC; ours offer no ALPN and speak the Upgrade handshake. A
// per-handshake configuration (certificate reload) gets it too.
func withH2(c *tls.Config) *tls.Config {
	c = c.Clone()
	if !slices.Contains(c.NextProtos, "h2") {
		c.NextProtos = append(c.NextProtos, "h2")
	}
	if get := c.GetConfigForClient; get != nil {
		c.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			cc, err := get(hello)
			if err != nil || cc == nil {
				return cc, err
			}
			cc = cc.Clone()
			if !slices.Contains(cc.NextProtos, "h2") {
				cc.NextProtos = append(cc.NextProtos, "h2")
			}
			return cc, nil
		}
	}
	return c
}

// ErrServerClosed is returned by the Serve methods after Shutdown or Close.
var ErrServerClosed = errors.New("server closed")

func (s *Server) track(ln *net.Listener, add bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if add {
		if s.shutting {
			return false
		}
		s.listeners[ln] = struct{}{}
	} else {
		delete(s.listeners, ln)
	}
	return true
}

// goroutine starts f as a goroutine the server owns and waits for on Close.
// A panic in f is recovered and logged: it ends f's connection only.
func (s *Server) goroutine(f func()) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer recoverTunnelPanic(s.log, s.metrics.panics, "server")
		f()
	}()
}

// serve runs an accept loop until ln is closed by Shutdown or Close. With
// countPending, each accepted connection counts as pending until its
// handler calls release (once its dial is answered): Shutdown waits for
// those before it sends GOAWAY, so a connection accepted just before a
// restart is still served, not dropped.
func (s *Server) serve(ln net.Listener, countPending bool, handle func(c net.Conn, release func())) error {
	if !s.track(&ln, true) {
		ln.Close()
		return ErrServerClosed
	}
	s.acceptLoops.Add(1)
	defer s.acceptLoops.Done()
	defer s.track(&ln, false)
	var tempDelay time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if s.isShutting() {
				return ErrServerClosed
			}
			if countPending && (errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE)) && s.refuseWithSpare(ln) {
				continue // one waiting client got its 503; the rest wait or come back
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || isTemporaryAccept(err) {
				// Out of file descriptors or similar: back off, keep serving.
				tempDelay = min(max(2*tempDelay, 5*time.Millisecond), time.Second)
				s.quiet.log(s.log, slog.LevelWarn, "accept "+ln.Addr().String(), "accept failed; retrying", "addr", ln.Addr().String(), "err", err, "delay", tempDelay)
				select {
				case <-time.After(tempDelay):
				case <-s.baseCtx.Done():
					return ErrServerClosed
				}
				continue
			}
			return fmt.Errorf("accept on %s: %w", ln.Addr(), err)
		}
		tempDelay = 0
		release := func() {}
		if countPending {
			s.pending.Add(1)
			var once sync.Once
			release = func() { once.Do(func() { s.pending.Add(-1) }) }
		}
		s.goroutine(func() {
			defer release()
			handle(c, release)
		})
	}
}

// refuseWithSpare answers one queued frontend connection with 503 when
// the process is out of file descriptors: it gives up the spare descriptor
// kept for this, accepts, answers, closes, and takes the spare back. A
// client is told at once instead of waiting in the backlog.
func (s *Server) refuseWithSpare(ln net.Listener) bool {
	s.mu.Lock()
	spare := s.spareFD
	s.spareFD = nil
	s.mu.Unlock()
	if spare == nil {
		return false
	}
	spare.Close()
	c, err := ln.Accept()
	if err == nil {
		s.metrics.dialFailed(&StatusError{Code: http.StatusServiceUnavailable, Reason: reasonNoFD})
		c.SetDeadline(time.Now().Add(time.Second))
		if _, isUnix := c.(*net.UnixConn); isUnix {
			writeStatus(c, http.StatusServiceUnavailable, "server out of file descriptors (too many open files); retry later")
		}
		c.Close()
	}
	s.quiet.log(s.log, slog.LevelWarn, "emfile", "out of file descriptors: refusing frontend connections with 503", "addr", ln.Addr().String())
	s.mu.Lock()
	if !s.closed {
		s.spareFD, _ = os.Open(os.DevNull)
	}
	s.mu.Unlock()
	return err == nil
}

func (s *Server) isShutting() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.shutting
}

// ServeFrontend accepts HTTP CONNECT connections (kube-apiserver's
// HTTPConnect egress protocol) on ln until Shutdown or Close.
func (s *Server) ServeFrontend(ln net.Listener) error {
	return s.serve(ln, true, s.serveFrontendConn)
}

// ServeAgents accepts agent connections on ln until Shutdown or Close.
func (s *Server) ServeAgents(ln net.Listener) error {
	return s.serve(ln, false, func(c net.Conn, _ func()) { s.serveAgentConn(c) })
}

// AgentCount is the number of connected agents.
func (s *Server) AgentCount() int { return s.agents.len() }

// Ready reports whether at least one agent is connected.
func (s *Server) Ready() (bool, string) {
	n := s.agents.len()
	if n == 0 {
		return false, "no agent connected"
	}
	return true, fmt.Sprintf("%d agent(s) connected", n)
}

func (s *Server) trackFrontend(c net.Conn, add bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if add {
		if s.closed {
			return false
		}
		s.frontends[c] = struct{}{}
		return true
	}
	delete(s.frontends, c)
	return true
}

// Shutdown stops accepting, answers the dials already accepted, then sends
// GOAWAY to every agent and waits for open tunnels to finish until ctx
// ends; then it closes what is left.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.shutting = true
	for ln := range s.listeners {
		(*ln).Close()
	}
	s.mu.Unlock()
	s.acceptLoops.Wait()
	// Agents still take new streams here, so accepted dials complete.
	for s.pending.Load() > 0 && ctx.Err() == nil {
		time.Sleep(2 * time.Millisecond)
	}

	var wg sync.WaitGroup
	for _, a := range s.agents.snapshot() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.shutdown(ctx)
		}()
	}
	drained := make(chan struct{})
	go func() { wg.Wait(); close(drained) }()
	var err error
	select {
	case <-drained:
	case <-ctx.Done():
		err = ctx.Err()
	}
	// The agents' streams are done, but the last bytes may still be on
	// their way to the clients: let the frontend connections finish too.
	for err == nil && s.openFrontends() > 0 {
		select {
		case <-ctx.Done():
			err = ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	s.Close()
	<-drained
	return err
}

func (s *Server) openFrontends() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.frontends)
}

// Close ends every listener, agent connection and tunnel at once, and waits
// for the server's goroutines to return.
func (s *Server) Close() error {
	s.mu.Lock()
	s.shutting = true
	s.closed = true
	for ln := range s.listeners {
		(*ln).Close()
	}
	for c := range s.frontends {
		c.Close()
	}
	s.mu.Unlock()
	s.cancelAll()
	for _, a := range s.agents.snapshot() {
		a.close()
	}
	s.wg.Wait()
	s.mu.Lock()
	if s.spareFD != nil {
		s.spareFD.Close()
		s.spareFD = nil
	}
	s.mu.Unlock()
	return nil
}

// serveAgentConn runs one agent connection: TLS, the Upgrade handshake, then
// HTTP/2 with this server as the client, until the connection ends.
func (s *Server) serveAgentConn(raw net.Conn) {
	remote := raw.RemoteAddr().String()
	pc := s.gate.enter(raw, s.cfg.HeaderTimeout)
	if pc == nil {
		s.Stats.AgentsRefused.Add(1)
		s.quiet.log(s.log, slog.LevelWarn, "unadmitted limit", "agent connection closed: too many connections waiting to be admitted", "remote", remote, "limit", s.cfg.MaxUnadmitted)
		return
	}
	defer pc.release()
	conn := raw
	var tlsState tls.ConnectionState
	deadline := time.Now().Add(s.cfg.HeaderTimeout)
	raw.SetDeadline(deadline)
	if s.cfg.AgentTLS != nil {
		tc := tlsServer(raw, s.cfg.AgentTLS)
		ctx, cancel := context.WithDeadline(s.baseCtx, deadline)
		err := tc.HandshakeContext(ctx)
		cancel()
		if err != nil {
			s.Stats.AgentsRefused.Add(1)
			// Debug: load-balancer health checks look exactly like this.
			s.log.Debug("agent TLS handshake failed", "remote", remote, "err", err)
			raw.Close()
			return
		}
		tlsState = tc.ConnectionState()
		conn = tc
		if tlsState.NegotiatedProtocol == "h2" {
			// Upstream's agent: gRPC AgentService/Connect on the same port.
			raw.SetDeadline(time.Time{})
			s.serveUpstreamAgent(conn, tlsState, remote, pc)
			return
		}
	}
	lim := &headLimiter{r: conn, remaining: maxHandshakeHead, limited: true}
	br := bufio.NewReaderSize(lim, 4096)
	hello, err := readHello(br)
	var principal Principal
	var ids Identifiers
	if err == nil {
		ctx, cancel := context.WithDeadline(s.baseCtx, deadline)
		stop := watchHangup(conn, cancel)
		principal, ids, err = s.admit(ctx, hello, tlsState, remote)
		if !stop() && err == nil {
			err = statusErrorf(http.StatusBadRequest, "the agent hung up or sent data before the handshake answer")
		}
		cancel()
		conn.SetReadDeadline(deadline)
	}
	if err != nil {
		code := StatusCode(err)
		switch {
		case code == http.StatusConflict: // a duplicate: expected while agents seek every server
		case hello.ID == "":
			// Not an agent at all (a probe, a port scan): count it, log at debug.
			s.Stats.AgentsRefused.Add(1)
			s.log.Debug("not an agent handshake", "remote", remote, "status", code, "reason", errMsg(err))
		default:
			s.Stats.AgentsRefused.Add(1)
			s.quiet.log(s.log, slog.LevelInfo, "refused "+hostOf(remote), "agent refused", "agent", hello.ID, "remote", remote, "status", code, "reason", errMsg(err))
		}
		conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
		writeStatus(conn, code, errMsg(err))
		conn.Close()
		return
	}
	if !pc.admit() {
		conn.Close() // the header timeout came first
		return
	}
	if err := writeSwitching(conn, s.cfg.ID, s.cfg.Count); err != nil {
		conn.Close()
		return
	}
	lim.limited = false
	conn.SetDeadline(time.Time{})

	// The agent sends nothing more until it has read the 101, so the
	// handshake's buffer is normally empty and can be let go.
	var h2conn net.Conn = conn
	if br.Buffered() > 0 {
		h2conn = &bufferedConn{Conn: conn, r: br}
	}
	wc := newWatchedConn(h2conn)
	link, err := h2link.NewClient(wc, h2link.Config{KeepAlive: s.cfg.KeepAlive, PingTimeout: s.cfg.PingTimeout, Spawn: s.goroutine, Batch: batcherOf(wc)})
	if err != nil {
		s.log.Info("agent HTTP/2 setup failed", "agent", hello.ID, "remote", remote, "err", err)
		wc.Close()
		return
	}
	ctlCtx, stopControl := context.WithCancel(s.baseCtx)
	a := &agentConn{id: hello.ID, ids: ids, remote: remote, since: time.Now(), link: link, conn: wc, stopControl: stopControl, principal: principal}
	if !s.register(a, hello.Token, tlsState) {
		stopControl()
		a.endCredential()
		s.log.Info("agent refused: its ID was taken by another credential during the login", "agent", a.id, "remote", remote)
		link.Close()
		return
	}
	s.log.Info("agent connected", "agent", a.id, "remote", remote, "identifiers", hello.Identifiers, "routed_by", ids.String(), "agents", s.agents.len())
	// No goroutine waits for the connection to end (an idle agent costs
	// what it holds, not a parked stack): closing it unregisters the agent.
	wc.onClose(func() {
		stopControl()
		a.endCredential()
		s.agents.remove(a)
		s.log.Info("agent disconnected", "agent", a.id, "remote", remote, "reason", wc.closeReason(), "connected_for", time.Since(a.since).Round(time.Millisecond).String(), "agents", s.agents.len())
	})
	s.goroutine(func() { s.watchControl(ctlCtx, a) })
}

// watchControl reads the agent's control stream: one line per event.
func (s *Server) watchControl(ctx context.Context, a *agentConn) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://agent"+controlPath, nil)
	if err != nil {
		return
	}
	resp, err := a.link.RoundTrip(req)
	if err != nil {
		return
	}
	defer resp.Body.Close()
	// A small reader: this sits idle on every agent connection.
	lines := bufio.NewReaderSize(resp.Body, 64)
	for {
		line, err := readControlLine(lines)
		if err != nil {
			return
		}
		line = strings.TrimSpace(line)
		if token, ok := strings.CutPrefix(line, controlToken+" "); ok {
			s.newToken(a, strings.TrimSpace(token))
			continue
		}
		switch line {
		case controlDrain:
			s.metrics.packets.inc(segFromAgent, grpcwire.Drain)
			a.draining.Store(true)
			s.log.Info("agent draining: new dials prefer other agents", "agent", a.id, "remote", a.remote)
		}
	}
}

// admit runs the cheap checks first and authentication last, so a duplicate
// connection costs no token review; then it checks that the credential
// backs the agent's ID and identifiers (identity.go). ctx bounds both,
// under one review slot (admission.go): the connection's deadline, or the
// login stream's life. It returns the identifiers to register the agent
// with: those the credential backs.
func (s *Server) admit(ctx context.Context, h agentHello, tlsState tls.ConnectionState, remote string) (Principal, Identifiers, error) {
	if slices.Contains(h.Held, s.cfg.ID) {
		return Principal{}, Identifiers{}, statusErrorf(http.StatusConflict, "agent already holds a connection to server %s", s.cfg.ID)
	}
	if s.isShutting() {
		return Principal{}, Identifiers{}, statusErrorf(http.StatusServiceUnavailable, "server is shutting down")
	}
	ids, err := parseFromAgent(h.Identifiers)
	if err != nil {
		return Principal{}, Identifiers{}, statusErrorf(http.StatusBadRequest, "%v", err)
	}
	var p Principal
	err = s.review(ctx, h.ID, remote, func(ctx context.Context) error {
		var err error
		if p, err = s.authenticate(ctx, AgentCredentials{AgentID: h.ID, Token: h.Token, TLS: tlsState}); err != nil {
			return err
		}
		ids, err = s.checkIdentity(ctx, p, h.ID, ids)
		return err
	})
	if err != nil {
		return Principal{}, Identifiers{}, err
	}
	return p, ids, nil
}

func errMsg(err error) string {
	var se *StatusError
	if errors.As(err, &se) {
		return se.Msg
	}
	return err.Error()
}

// serveFrontendConn answers one CONNECT request and, on success, carries the
// connection's bytes to and from an agent stream until both sides are done.
func (s *Server) serveFrontendConn(conn net.Conn, release func()) {
	if !s.trackFrontend(conn, true) {
		conn.Close()
		return
	}
	s.Stats.FrontendOpen.Add(1)
	s.metrics.httpConns.Add(1)
	defer func() {
		s.metrics.httpConns.Add(-1)
		s.Stats.FrontendOpen.Add(-1)
		s.trackFrontend(conn, false)
		conn.Close()
	}()
	st, up := s.openFrontendTunnel(conn, release)
	if st == nil {
		return
	}
	defer st.close()
	s.hangups.add(conn, func() {
		s.log.Debug("client closed its socket; ending the tunnel")
		st.close()
		conn.Close()
	})
	defer s.hangups.remove(conn)
	up.start()
	if body, ok := st.body.(*h2link.Body); ok && up.callerSends {
		s.carryDirect(conn, st, body)
		return
	}
	s.carryCopy(conn, st, up)
}

// openFrontendTunnel reads the CONNECT request, checks the peer, opens a
// stream through an agent and tells the client 200. On failure it answers
// the error itself and returns nil. It returns before the tunnel parks:
// see "Parked stacks" in doc.go.
func (s *Server) openFrontendTunnel(conn net.Conn, release func()) (*stream, *upload) {
	headDeadline := time.Now().Add(s.cfg.HeaderTimeout)
	conn.SetDeadline(headDeadline)
	lim := &headLimiter{r: conn, remaining: maxConnectHead, limited: true}
	br := headReaders.Get().(*bufio.Reader) // back to the pool once drained: see sendBuffered
	br.Reset(lim)
	addr, err := readConnect(br)
	if err != nil && StatusCode(err) == http.StatusBadRequest && !time.Now().Before(headDeadline) {
		// net/http reports a line cut short by the deadline as malformed.
		err = statusErrorf(http.StatusRequestTimeout, "request head not received in time")
	}
	if err != nil {
		s.Stats.DialsFailed.Add(1)
		s.metrics.dialFailed(err)
		s.log.Debug("bad CONNECT request", "err", err)
		conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
		writeStatus(conn, StatusCode(err), errMsg(err))
		return nil, nil
	}
	// The peer is checked after its request is read: closing a Unix socket
	// with unread data resets it, and the client would never see the 403.
	if s.cfg.CheckFrontendPeer != nil {
		if err := s.cfg.CheckFrontendPeer(conn); err != nil {
			s.Stats.DialsFailed.Add(1)
			s.metrics.dialFailed(&StatusError{Code: http.StatusForbidden})
			s.quiet.log(s.log, slog.LevelWarn, "peer", "frontend peer refused", "err", err)
			conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
			writeStatus(conn, http.StatusForbidden, errMsg(err))
			return nil, nil
		}
	}
	lim.limited = false
	conn.SetDeadline(time.Time{})
	s.metrics.packets.inc(segFromClient, grpcwire.DialReq) // a CONNECT request read and its peer admitted

	up := newUpload(br, func() { conn.SetReadDeadline(time.Now()) }, s.goroutine)
	up.raw = rawSocket(conn)
	up.callerSends = up.raw != nil // a link sends it from here: see carryDirect
	up.counters = []*atomic.Int64{&s.Stats.BytesToAgent}
	st, err := s.open(addr, up)
	release()
	if err != nil {
		s.Stats.DialsFailed.Add(1)
		s.metrics.dialFailed(err)
		s.log.Debug("dial failed", "addr", addr, "err", err)
		if failureReason(err) == reasonFrontendClosed {
			s.metrics.packets.inc(segFromClient, grpcwire.DialCls) // the client hung up during the dial
		}
		conn.SetWriteDeadline(time.Now().Add(s.cfg.HeaderTimeout))
		s.metrics.packets.inc(segToClient, grpcwire.DialRsp)
		writeStatus(conn, StatusCode(err), errMsg(err))
		return nil, nil
	}
	s.Stats.DialsOK.Add(1)
	s.metrics.packets.inc(segToClient, grpcwire.DialRsp)
	written := time.Now()
	_, err = io.WriteString(conn, connectEstablished)
	s.metrics.frontendWrite.ObserveDuration(time.Since(written))
	if err != nil {
		st.close()
		return nil, nil
	}
	up.packets = packetCounter{&s.metrics.packets.n[segFromClient][grpcwire.Data], &s.metrics.packets.n[segToAgent][grpcwire.Data]}
	up.closes = packetCounter{&s.metrics.packets.n[segFromClient][grpcwire.CloseReq], &s.metrics.packets.n[segToAgent][grpcwire.CloseReq]}
	return st, up
}

// carryCopy carries a tunnel whose stream sends the upload itself (an
// upstream agent) or whose client is not a plain socket: this goroutine
// copies what the agent sends to the client.
func (s *Server) carryCopy(conn net.Conn, st *stream, up *upload) {
	// Each write to the client is a DATA Packet received from the agent and
	// sent on to the client.
	to := &packetWriter{w: conn, c: packetCounter{&s.metrics.packets.n[segFromAgent][grpcwire.Data], &s.metrics.packets.n[segToClient][grpcwire.Data]}}
	n, err := copyStream(to, st.body, nil)
	s.Stats.BytesFromAgent.Add(n)
	st.agent.bytesFrom.Add(n)
	if err != nil {
		// The agent reset the stream or the client went away: abort both.
		s.metrics.resets.Inc()
		s.metrics.streamErrs.inc(segFromAgent, streamErrorCode(err), grpcwire.Data)
		return
	}
	s.metrics.countEnd()
	// The destination finished sending. Pass the half-close on and wait for
	// the client to finish sending too (or for the agent to stop reading).
	closeWrite(conn)
	select {
	case <-up.done:
	case <-s.baseCtx.Done():
	}
}

// carryDirect carries a tunnel on a link between a plain client socket
// and the stream with this one goroutine: it sends the upload itself while
// the link's read loop writes what the agent sends straight to the socket
// (see sink.go).
func (s *Server) carryDirect(conn net.Conn, st *stream, body *h2link.Body) {
	down := body.DeliverTo(conn, func(err error) error {
		if err != nil {
			conn.SetReadDeadline(time.Now()) // the upload ends too
			return err
		}
		// The destination finished sending: pass the half-close on; the
		// client may still send.
		closeWrite(conn)
		return nil
	})
	body.SendUpload()
	// The client finished sending (or the stream ended): wait for the
	// destination's end.
	select {
	case <-down.Done():
	case <-s.baseCtx.Done():
		st.close()
		<-down.Done()
	}
	n, err := down.Result()
	s.Stats.BytesFromAgent.Add(n)
	st.agent.bytesFrom.Add(n)
	if err != nil {
		s.metrics.resets.Inc()
		s.metrics.streamErrs.inc(segFromAgent, streamErrorCode(err), grpcwire.Data)
		return
	}
	s.metrics.countEnd()
}

// maxConnectHead bounds a CONNECT request head; kube-apiserver's is ~50 bytes.
const maxConnectHead = 16 << 10

// headReaders recycles the 4 KiB readers of CONNECT heads, one per dial
// for a head of about fifty bytes. A reader goes back only from the path
// where nothing else can still hold it (the upload has drained it after the
// client was told 200); readers of dials that failed are left to the
// collector.
var headReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4096) }}

// stream is one open tunnel through an agent.
type stream struct {
	agent   *agentConn
	body    io.ReadCloser
	cancel  context.CancelFunc
	once    sync.Once
	since   time.Time
	metrics *serverMetrics
}

// close ends the tunnel (RST_STREAM if it is still open); safe to repeat.
func (st *stream) close() {
	st.once.Do(func() {
		st.body.Close()
		st.cancel()
		st.agent.streams.Add(-1)
		st.metrics.established.Add(-1)
		st.metrics.connDuration.ObserveDuration(time.Since(st.since))
	})
}

// Dial-failure reasons, also used as metric labels.
const (
	reasonNoAgent        = "no_agent"
	reasonErrorResponse  = "error_response"
	reasonDialTimeout    = "backend_dial_timeout"
	reasonFrontendClosed = "frontend_close"
	reasonBadRequest     = "bad_request"
	reasonForbidden      = "forbidden"
	reasonBackendClosed  = "backend_close"
	reasonShutdown       = "shutdown"
	reasonNoFD           = "too_many_open_files"
)

// failureReason names why a dial failed, for the dial_failure_count metric.
func failureReason(err error) string {
	var se *StatusError
	if !errors.As(err, &se) {
		return reasonBackendClosed // the agent connection broke mid-dial
	}
	if se.Reason != "" {
		return se.Reason
	}
	switch se.Code {
	case http.StatusBadRequest, http.StatusMethodNotAllowed, http.StatusRequestTimeout, http.StatusRequestHeaderFieldsTooLarge:
		return reasonBadRequest
	case http.StatusForbidden:
		return reasonForbidden
	case http.StatusGatewayTimeout:
		return reasonDialTimeout
	}
	return reasonErrorResponse
}

// open picks an agent and opens a CONNECT stream to addr through it. It
// returns once the agent has dialled the destination, or with a *StatusError.
// A dial that meets a connection that died before the agent answered is
// retried on another agent: nothing was sent, so nothing is lost.
func (s *Server) open(addr string, up *upload) (*stream, error) {
	start := time.Now()
	s.metrics.pending.Add(1)
	defer s.metrics.pending.Add(-1)
	host := hostOf(addr)
	deadline := time.Now().Add(s.cfg.DialTimeout)
	tried := map[*agentConn]bool{}
	for attempt := 0; ; attempt++ {
		a, err := s.waitAgent(host, tried, up)
		if err != nil {
			return nil, err
		}
		st, err := s.roundTrip(a, addr, up, deadline)
		if err == nil {
			st.since, st.metrics = time.Now(), s.metrics
			up.counters = append(up.counters, &a.bytesTo) // read only after start
			s.metrics.established.Add(1)
			s.metrics.dialDuration.ObserveDuration(time.Since(start))
			return st, nil
		}
		var se *StatusError
		if errors.As(err, &se) || attempt >= 2 || time.Now().After(deadline) {
			return nil, err
		}
		tried[a] = true
		s.log.Debug("dial retried on another agent", "addr", addr, "agent", a.id, "err", err)
	}
}

// waitAgent returns an agent for host, waiting up to AgentWait for one to
// connect. It gives up early if the client goes away.
func (s *Server) waitAgent(host string, exclude map[*agentConn]bool, up *upload) (*agentConn, error) {
	maxStreams := int64(s.cfg.MaxStreamsPerAgent)
	var timer *time.Timer
	for {
		changed := s.agents.waitChan()
		if a := s.agents.pick(host, s.cfg.Strategies, maxStreams, exclude); a != nil {
			if timer != nil {
				timer.Stop()
			}
			return a, nil
		}
		if timer == nil {
			timer = time.NewTimer(s.cfg.AgentWait)
			defer timer.Stop()
		}
		select {
		case <-changed:
		case <-timer.C:
			return nil, statusErrorf(http.StatusServiceUnavailable, "no agent available for %s: waited %s", host, s.cfg.AgentWait).withReason(reasonNoAgent)
		case <-up.clientGone:
			return nil, statusErrorf(http.StatusServiceUnavailable, "client closed the connection while waiting for an agent").withReason(reasonFrontendClosed)
		case <-s.baseCtx.Done():
			return nil, statusErrorf(http.StatusServiceUnavailable, "server shutting down").withReason(reasonShutdown)
		}
	}
}

// roundTrip sends the CONNECT stream to one agent and waits for its answer.
// The request context lives as long as the tunnel, so the dial deadline is a
// timer that cancels it only while the answer is outstanding.
func (s *Server) roundTrip(a *agentConn, addr string, up *upload, deadline time.Time) (*stream, error) {
	ctx, cancel := context.WithCancel(s.baseCtx)
	var why atomic.Value // string: why ctx was cancelled before the answer
	timer := time.AfterFunc(time.Until(deadline), func() { why.Store(reasonDialTimeout); cancel() })
	stopGone := context.AfterFunc(up.clientGoneCtx, func() { why.Store(reasonFrontendClosed); cancel() })

	body := up.attempt()
	req := &http.Request{
		Method: http.MethodConnect,
		URL:    &url.URL{Host: addr},
		Host:   addr,
		Header: make(http.Header),
		Body:   body,
	}
	req = req.WithContext(ctx)
	a.streams.Add(1)
	s.metrics.packets.inc(segToAgent, grpcwire.DialReq)
	resp, err := a.roundTrip(req)
	timer.Stop()
	stopGone()
	if err != nil {
		if why.Load() == reasonFrontendClosed {
			s.metrics.packets.inc(segToAgent, grpcwire.DialCls) // RST_STREAM before the answer
		} else {
			s.metrics.streamErrs.inc(segToAgent, streamErrorCode(err), grpcwire.DialReq)
		}
		body.abandon()
		a.streams.Add(-1)
		cancel()
		switch why.Load() {
		case reasonDialTimeout:
			return nil, statusErrorf(http.StatusGatewayTimeout, "dial %s through agent %s: no answer within %s", addr, a.id, s.cfg.DialTimeout).withReason(reasonDialTimeout)
		case reasonFrontendClosed:
			return nil, statusErrorf(http.StatusServiceUnavailable, "client closed the connection during the dial").withReason(reasonFrontendClosed)
		}
		return nil, fmt.Errorf("dial %s through agent %s: %w", addr, a.id, err)
	}
	s.metrics.packets.inc(segFromAgent, grpcwire.DialRsp)
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		resp.Body.Close()
		body.abandon()
		a.streams.Add(-1)
		cancel()
		code := resp.StatusCode
		if code != http.StatusGatewayTimeout && code != http.StatusForbidden && code != http.StatusBadRequest {
			code = http.StatusBadGateway
		}
		return nil, statusErrorf(code, "agent %s: %s", a.id, strings.TrimSpace(cleanErr(errors.New(strings.TrimSpace(string(msg))))))
	}
	return &stream{agent: a, body: resp.Body, cancel: cancel}, nil
}
