package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/sys/unix"

	"github.com/spinifex/konnectivity/internal/promtext"
)

// AgentCredentials is what an agent presented when it connected.
type AgentCredentials struct {
	AgentID string
	Token   string // bearer token, empty if none; never log it
	TLS     tls.ConnectionState
}

// Config configures a Server. Zero durations take the defaults below.
type Config struct {
	ID    string // announced to agents; required
	Count int    // how many server replicas agents should reach

	// AgentTLS is used for the agent listener; required. It should verify
	// client certificates if mTLS is wanted (VerifyClientCertIfGiven lets
	// token agents in too).
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

	Strategies []Strategy
	// NodeOf names the node the apiserver says owns a destination host (a
	// node address, a pod address, an address in a pod CIDR), or "" when
	// none does; the node strategy routes the dial to the agent bound to
	// that node. loaded is false until the server has read the apiserver's
	// view once, so a refusal can tell "no node owns it" from "not known
	// yet". Required when Strategies holds StrategyNode. It is called for
	// every dial, under no lock of the server.
	NodeOf func(host string) (node string, loaded bool)

	AgentWait          time.Duration // how long a dial waits for an agent to appear (default 5s)
	DialTimeout        time.Duration // bound from CONNECT to the agent's answer (default 10s)
	HeaderTimeout      time.Duration // bound on reading a request head or handshake (default 10s)
	KeepAlive          time.Duration // idle time before an HTTP/2 PING (default 30s)
	PingTimeout        time.Duration // how long a PING may go unanswered (default 15s)
	MaxStreamsPerAgent int           // open tunnels per agent before it is skipped (default 10000)
	// CreditStallAfter is how long an agent link's writers may wait for
	// connection credit none of them is given, or the link owe the agent
	// credit, before it counts a credit stall (h2link's stall.go; default
	// 10s).
	CreditStallAfter time.Duration
	// MaxUnadmitted bounds the agent-port connections accepted and not yet
	// admitted (default 64); MaxReviews the AuthenticateAgent calls in
	// flight (default 32). See admission.go.
	MaxUnadmitted int
	MaxReviews    int
	// StalledBudget bounds the bytes the agents' streams hold queued for
	// clients that do not read, across all of them (each tunnel up to its
	// 1 MiB window); past it a new dial gets 503, so that stalled readers
	// cannot grow the process without end (default 1 GiB).
	StalledBudget int64
	// MaxAgentsPerCredential bounds the agent connections (and so agent
	// IDs, one per connection) one credential holds from one address: a
	// login past it is refused 429 naming the bound. A real node's agent
	// holds one per server. 0: no bound.
	MaxAgentsPerCredential int
	// MaxAgentConns bounds the agent-port connections the server holds
	// (registered agents plus MaxUnadmitted), so that the descriptors
	// above it stay for the front door and the health and admin ports:
	// past it an agent-port connection is refused at once (503 with when
	// to come back). 0: no bound.
	MaxAgentConns int

	// Metrics receives the server's metrics; nil makes a private registry.
	Metrics *promtext.Registry

	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	wire.DefaultDuration(&c.AgentWait, 5*time.Second)
	wire.DefaultDuration(&c.DialTimeout, 10*time.Second)
	wire.DefaultDuration(&c.HeaderTimeout, 10*time.Second)
	wire.DefaultDuration(&c.KeepAlive, 30*time.Second)
	wire.DefaultDuration(&c.PingTimeout, 15*time.Second)
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
	if c.StalledBudget <= 0 {
		c.StalledBudget = 1 << 30
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
//
// Locks, in the order they may be taken (tunnel/doc.go, "Locks"): mu, then
// the registry's (agents.mu), then an agent's link; the rest are leaves.
type Server struct {
	// Immutable after New.
	cfg      Config
	log      *slog.Logger
	agents   *registry // its own lock: see registry
	metrics  *serverMetrics
	gate     *admission // agent-port connections before they are admitted; its own lock
	identity *identityState
	warnings *wire.LogLimiter // repeated warnings: one line per key per 10s; its own lock
	replaced *replacements    // logins that replaced a connection of their ID (replaced.go); its own lock
	nodeRank int              // index of StrategyNode in cfg.Strategies; -1 when it is off

	// baseCtx is cancelled by Close, ending every tunnel and handshake.
	baseCtx   context.Context
	cancelAll context.CancelFunc
	// leaving is cancelled when a shutdown begins: what a peer has not
	// asked for yet stops waiting for it (a CONNECT head a handover
	// takes, a gRPC connection with no call).
	leaving     context.Context
	stopLeaving context.CancelFunc

	mu sync.Mutex
	// listeners are the open listeners; guarded by mu.
	listeners map[*net.Listener]struct{}
	// tunnels is the one table of tunnels, from a frontend connection's
	// accept (or a gRPC call's DIAL_REQ) until the goroutine serving it
	// returns, and of the held ones no goroutine serves (tunnel.go:
	// paused tunnels waiting for their agent, connections a handover took
	// before anything was asked) until they are resumed, passed on or
	// dropped; guarded by mu, as is each tunnel's state.
	tunnels   map[*tunnel]struct{}
	inState   [numTunnelStates]int // guarded by mu: how many of tunnels are in each state; counted by moveLocked
	grpcConns int                  // guarded by mu: open gRPC front door connections (enterGRPCConn)
	emptied   chan struct{}        // guarded by mu: closed when both are empty but for held tunnels (waitTunnels)
	// hand is the restart handover (handover.go): its state is guarded
	// by mu too.
	hand *handover
	// The server's state; guarded by mu.
	shutting bool     // no new connections are accepted
	closed   bool     // everything is being torn down
	spareFD  *os.File // guarded by mu: released to answer 503 when out of file descriptors

	wg          sync.WaitGroup // every goroutine the server starts
	acceptLoops sync.WaitGroup
	queued      atomic.Int64  // bytes queued on our agents' links for clients (h2link.Config.Queued): see StalledBudget
	pending     atomic.Int64  // dials asked for whose tunnel cannot be paused yet, and resumes under way until theirs can
	answered    chan struct{} // guarded by mu: closed when pending drops to 0 (waitPending)

	Stats         Stats
	nextConnectID atomic.Int64 // gRPC frontend connection IDs
}

// Stats are counters an operator reads through metrics and status.
type Stats struct {
	AgentsRefused                atomic.Int64
	BytesToAgent, BytesFromAgent atomic.Int64
	ClosedQuiet                  atomic.Int64 // tunnels a drain closed at a quiet moment
}

// New checks cfg and returns a Server that is not yet serving.
func New(cfg Config) (*Server, error) {
	cfg.setDefaults()
	if err := wire.ValidID(cfg.ID); err != nil {
		return nil, fmt.Errorf("server %w", err)
	}
	nodeRank := slices.Index(cfg.Strategies, StrategyNode)
	if nodeRank >= 0 && cfg.NodeOf == nil {
		return nil, errors.New("the node proxy strategy needs server.Config.NodeOf")
	}
	if cfg.AgentTLS == nil {
		return nil, errors.New("server.Config.AgentTLS is required: agents connect over TLS")
	}
	cfg.AgentTLS = withH2(cfg.AgentTLS)
	ctx, cancel := context.WithCancel(context.Background())
	leaving, stopLeaving := context.WithCancel(ctx)
	s := &Server{
		leaving:     leaving,
		stopLeaving: stopLeaving,
		cfg:         cfg,
		log:         cfg.Logger,
		agents:      newRegistry(),
		baseCtx:     ctx,
		cancelAll:   cancel,
		listeners:   make(map[*net.Listener]struct{}),
		tunnels:     make(map[*tunnel]struct{}),
		nodeRank:    nodeRank,
	}
	s.hand = newHandover(s)
	s.metrics = newServerMetrics(cfg.Metrics, s)
	s.gate = newAdmission(cfg.Metrics, cfg.MaxUnadmitted, cfg.MaxReviews)
	s.identity = newIdentityState(cfg.Metrics)
	s.warnings = wire.NewLogLimiter(10 * time.Second)
	s.replaced = newReplacements(cfg.Metrics)
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

// ErrClosed is returned by the Serve methods after Shutdown or Close.
var ErrClosed = errors.New("server closed")

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

// goroutineIfOpen is goroutine for a caller the server does not own (a
// context.AfterFunc, a timer, a link's callback): it starts f only while the server is not closed,
// deciding under mu, so its WaitGroup.Add comes before Close's Wait, which
// sets closed under mu first. It reports whether f was started.
func (s *Server) goroutineIfOpen(f func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.goroutine(f)
	return true
}

// goroutine starts f as a goroutine the server owns and waits for on Close.
// A panic in f is recovered and logged: it ends f's connection only. The
// caller is one of the server's own goroutines (or holds mu and checked
// closed): see goroutineIfOpen.
func (s *Server) goroutine(f func()) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer wire.RecoverTunnelPanic(s.log, s.metrics.panics, "server", false)
		f()
	}()
}

// serve runs an accept loop until ln is closed by Shutdown or Close. A
// front door's connection counts as pending only once its client asked for
// a dial (pendingDial): a shutdown waits for those, and for nothing a peer
// has not asked for yet. On the agent port (not a front door; handle is
// nil) a connection is counted as unadmitted as it is accepted and served
// by serveAgentConn; the loop accepts only while one more can be counted,
// unless the admissions stalled (admission.go): the rest wait in the
// listen backlog, until it is nearly full.
func (s *Server) serve(ln net.Listener, frontDoor bool, handle func(c net.Conn)) error {
	if !s.track(&ln, true) {
		ln.Close()
		return ErrClosed
	}
	s.acceptLoops.Add(1)
	defer s.acceptLoops.Done()
	defer s.track(&ln, false)
	var tempDelay time.Duration
	var backlog func() (queued, limit int) // the agent port's listen backlog; nil: not known
	var full func() bool
	if !frontDoor {
		if backlog = backlogOf(ln); backlog != nil {
			full = func() bool { return nearlyFull(backlog()) }
		}
	}
	stalled := false // the agent port: no slot freed within stallBound (admission.go)
	for {
		if !frontDoor && !stalled {
			stalled = s.gate.waitRoom(s.leaving, stallBound(s.cfg.HeaderTimeout), full) == roomStalled
		}
		c, err := ln.Accept()
		if err != nil {
			if s.isShutting() {
				return ErrClosed
			}
			if frontDoor && (errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE)) {
				if c, ok := s.acceptWithSpare(ln); ok {
					if c != nil { // descriptors were free again when it came
						s.goroutine(func() { handle(c) })
					}
					continue // or one waiting client got its 503; the rest wait or come back
				}
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || wire.IsTemporaryAccept(err) {
				// Out of file descriptors or similar: back off, keep serving.
				tempDelay = min(max(2*tempDelay, 5*time.Millisecond), time.Second)
				s.warnings.Log(s.log, slog.LevelWarn, "accept "+ln.Addr().String(), "accept failed; retrying", "addr", ln.Addr().String(), "err", err, "delay", tempDelay)
				select {
				case <-time.After(tempDelay):
				case <-s.baseCtx.Done():
					return ErrClosed
				}
				continue
			}
			return fmt.Errorf("accept on %s: %w", ln.Addr(), err)
		}
		tempDelay = 0
		if frontDoor {
			s.retakeSpare()
		}
		if !frontDoor && s.cfg.MaxAgentConns > 0 && s.agents.len()+s.cfg.MaxUnadmitted >= s.cfg.MaxAgentConns {
			s.goroutine(func() { s.refuseForDescriptors(c) })
			continue
		}
		if !frontDoor {
			// Counted here, before the next waitRoom looks at the count.
			pc := s.gate.enter(c, s.cfg.HeaderTimeout)
			stalled = stalled && pc == nil
			if pc == nil {
				queued, stall := 0, stalled
				if backlog != nil {
					queued, _ = backlog()
				}
				s.goroutine(func() { s.refuseUnadmitted(c, queued, stall) })
				continue
			}
			s.goroutine(func() { s.serveAgentConn(c, pc) })
			continue
		}
		s.goroutine(func() { handle(c) })
	}
}

// pendingDial is a dial from the moment its client asked for it (a
// CONNECT head read, a DIAL_REQ) until its tunnel is where a handover can
// pause it, or the dial failed: counted in Server.pending meanwhile.
type pendingDial struct {
	s *Server // immutable
	v atomic.Uint32
}

// The values of pendingDial.v.
const (
	dialNotAsked uint32 = iota
	dialCounted
	dialAnswered
)

// ask counts the dial as pending, once.
func (p *pendingDial) ask() {
	if p.v.CompareAndSwap(dialNotAsked, dialCounted) {
		p.s.pending.Add(1)
	}
}

// release ends the dial's count as pending; safe to repeat, and before
// ask (then ask counts nothing).
func (p *pendingDial) release() {
	if p.v.Swap(dialAnswered) == dialCounted {
		p.s.answeredOne()
	}
}

// answeredOne ends one dial's count as pending, and wakes waitPending when
// it was the last.
func (s *Server) answeredOne() {
	if s.pending.Add(-1) != 0 {
		return
	}
	s.mu.Lock()
	if s.answered != nil {
		close(s.answered)
		s.answered = nil
	}
	s.mu.Unlock()
}

// waitPending waits until every accepted connection's dial is answered, or
// ctx ends.
func (s *Server) waitPending(ctx context.Context) {
	s.mu.Lock()
	if s.pending.Load() == 0 {
		s.mu.Unlock()
		return
	}
	if s.answered == nil {
		s.answered = make(chan struct{})
	}
	answered := s.answered
	s.mu.Unlock()
	select {
	case <-answered:
	case <-ctx.Done():
	}
}

// acceptWithSpare is the front door's accept when the process is out of
// file descriptors: it gives up the spare descriptor reserved for this and
// accepts. The kernel refuses an accept for want of a descriptor before it
// looks for a connection, so the accept may wait for the next client,
// long after the shortage: the refusal is decided once a connection is
// there, by taking the spare back. If descriptors are free again, the
// connection is returned to be served; if not, it is answered 503 and
// closed (c nil), so a client is told at once instead of waiting in the
// backlog. ok is false when the accept failed.
func (s *Server) acceptWithSpare(ln net.Listener) (c net.Conn, ok bool) {
	s.mu.Lock()
	spare := s.spareFD
	s.spareFD = nil
	s.mu.Unlock()
	if spare == nil {
		return nil, false
	}
	spare.Close()
	c, err := ln.Accept()
	s.mu.Lock()
	closed := s.closed
	if !closed {
		s.spareFD, _ = os.Open(os.DevNull)
	}
	spared := s.spareFD != nil
	s.mu.Unlock()
	if err != nil {
		return nil, false
	}
	if closed {
		c.Close()
		return nil, true
	}
	if spared {
		return c, true
	}
	s.metrics.dialFailed(&wire.StatusError{Code: http.StatusServiceUnavailable, Reason: reasonNoFD})
	c.SetDeadline(time.Now().Add(time.Second))
	if _, isUnix := c.(*net.UnixConn); isUnix {
		wire.WriteStatus(c, http.StatusServiceUnavailable, "server out of file descriptors (too many open files); retry later")
	}
	c.Close()
	s.warnings.Log(s.log, slog.LevelWarn, "emfile", "out of file descriptors: refusing frontend connections with 503", "addr", ln.Addr().String())
	s.retakeSpare()
	return nil, true
}

// retakeSpare takes the spare descriptor back once descriptors are free
// again, if a refusal could not (it was taken meanwhile): the next
// descriptor storm is answered as the last one was.
func (s *Server) retakeSpare() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.spareFD == nil && !s.closed {
		s.spareFD, _ = os.Open(os.DevNull)
	}
}

// refuseForDescriptors answers an agent-port connection accepted while the
// agents hold MaxAgentConns connections: the descriptors above stay for
// the front door and the health and admin ports.
func (s *Server) refuseForDescriptors(c net.Conn) {
	s.Stats.AgentsRefused.Add(1)
	s.metrics.agentsRefusedFD.Inc()
	refuseBusy(c, agentFDRetry)
	s.warnings.Log(s.log, slog.LevelWarn, "agent descriptors", "agent connection refused: agents hold the descriptors they may (the rest is reserved for the front door, health and admin ports)", "remote", c.RemoteAddr().String(), "limit", s.cfg.MaxAgentConns)
}

// agentFDRetry is when an agent refused for descriptors is told to come back.
const agentFDRetry = 5 * time.Second

func (s *Server) isShutting() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.shutting
}

// ServeFrontend accepts HTTP CONNECT connections (kube-apiserver's
// HTTPConnect egress protocol) on ln until Shutdown or Close.
func (s *Server) ServeFrontend(ln net.Listener) error {
	return s.serve(ln, true, func(c net.Conn) {
		t := newHTTPTunnel(c)
		t.state = tunnelReading
		pd := &pendingDial{s: s}
		defer pd.release()
		s.serveFrontendConn(t, pd)
	})
}

// ServeAgents accepts agent connections on ln until Shutdown or Close.
func (s *Server) ServeAgents(ln net.Listener) error {
	return s.serve(ln, false, nil)
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

// Shutdown stops accepting, answers the dials already accepted, then sends
// GOAWAY to every agent and waits for open tunnels to finish until ctx
// ends; then it closes what is left.
func (s *Server) Shutdown(ctx context.Context) error {
	return s.shutdown(ctx, false)
}

// shutdown is Shutdown, and with handOver a restart's (HandOver): the
// handover's steps run at their places (handover.go).
func (s *Server) shutdown(ctx context.Context, handOver bool) error {
	s.mu.Lock()
	s.shutting = true
	for ln := range s.listeners {
		(*ln).Close()
	}
	if handOver {
		s.hand.beginLocked()
	}
	s.mu.Unlock()
	s.stopLeaving() // unasked reads and idle gRPC connections let go (leaving)
	s.agents.wake() // a resume waiting for its agent passes it on (waitAgentID)
	s.acceptLoops.Wait()
	// Agents still take new streams here, so accepted dials complete.
	s.waitPending(ctx)
	if handOver {
		s.hand.take()
	}
	// Tunnels that would never end (keep-alive connections) close at a
	// quiet moment, so their clients dial again and nothing is cut.
	stopQuiet := make(chan struct{})
	deadline, _ := ctx.Deadline()
	s.goroutine(func() { s.closeQuietTunnels(ctx, stopQuiet, nil, deadline) })
	defer func() {
		if n := s.Stats.ClosedQuiet.Load(); n > 0 {
			s.log.Info("drain: closed idle tunnels at a quiet moment", "tunnels", n)
		}
	}()
	if handOver {
		s.hand.pause(ctx)
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
	// their way to the clients: let the tunnels finish too.
	if err == nil {
		err = s.waitTunnels(ctx)
	}
	close(stopQuiet)
	s.Close()
	<-drained
	return err
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
	for t := range s.tunnels {
		if t.state == tunnelHeld {
			s.hand.dropHeldLocked(t)
			continue
		}
		t.front.closeSocket()
	}
	s.mu.Unlock()
	s.cancelAll()
	for _, a := range s.agents.snapshot() {
		a.opener.close()
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
