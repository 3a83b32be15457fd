package server

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// A handover moves open frontend tunnels from this server to the next
// image of its process (a self-restart), so that kube-apiserver's
// keep-alive connections to webhooks and kubelets live through it: no
// close, however well timed, can be told apart from a request sent in the
// same instant, and kube-apiserver does not retry a POST.
//
// A tunnel is paused at a byte-exact point in both directions, then
// resumed on a new stream:
//
//  1. The server stops reading the client's socket, having sent on every
//     byte it read (the stream stays open: h2link.ErrUploadStopped).
//  2. It asks the agent, on a new stream of the same connection:
//     POST pausePath with the tunnel's stream ID, the bytes it sent on the
//     tunnel, and a resume token it chose.
//  3. The agent waits until those bytes reached the destination, stops
//     reading the destination, sends what it read, keeps the destination
//     connection under the token (wire.ResumeWindow) and answers 200 with the
//     bytes it sent.
//  4. The server waits until those bytes reached the client, ends the old
//     stream, and keeps the client's socket for the next image (the
//     tunnel's goroutine leaves it open). Bytes either side sends meanwhile wait in the kernel.
//  5. The next image sends CONNECT to the same agent once it is back,
//     naming the token (hdrResumeToken); the agent answers with the held
//     connection, and the tunnel goes on.
//
// On the gRPC front door step 1 also stops reading the client's HTTP/2
// connection at a frame boundary, and step 4 freezes it (h2link.Frozen)
// once the call let its stream go; the part of a gRPC message read before
// the stop travels with it (PausedGRPC).
//
// Only what can move without loss is paused: a tunnel on a Unix-socket (or
// plain TCP) front door, through an agent that announced featurePause,
// with both directions open, alone on its connection. Everything else
// drains as with Shutdown (quiet.go), and a pause that fails at any step
// closes its tunnel, as a drain's deadline would. Only an open tunnel
// moves to pausing (tunnel.go), so a drain never closes a tunnel being
// paused.
//
// The wire words of the protocol (pausePath and its headers) are in
// handshake.go, with the rest of what both sides speak.

// resumeWait bounds how long the next image waits for a paused tunnel's
// agent to log in again when the tunnel does not say how long its resume
// can succeed (PausedTunnel.Until: one from an image that did not write
// it); less than the agent's wire.ResumeWindow.
const resumeWait = 20 * time.Second

// pauseTimeout bounds one tunnel's pause.
const pauseTimeout = 5 * time.Second

// PausedTunnel is a frontend tunnel paused for the next image of this
// process: the client's socket and what resuming it needs.
// All but File travel to the next image as JSON.
//
// An Unasked one is an HTTP CONNECT connection whose client had not asked
// for a dial yet (its head was not complete): it has no agent, no
// destination and no token, only the bytes read so far (Head), and the
// next image serves it as a new connection.
type PausedTunnel struct {
	Socket  net.Conn    `json:"-"`                 // the client's socket, the front door's own: no second descriptor (docs/restart.md)
	Addr    string      `json:"addr"`              // the destination, as the client asked for it
	Agent   string      `json:"agent"`             // the agent holding the destination connection
	Token   string      `json:"token"`             // the resume token the agent holds it under
	GRPC    *PausedGRPC `json:"grpc,omitempty"`    // set for a gRPC front door call
	Unasked bool        `json:"unasked,omitempty"` // a connection whose client asked for nothing yet
	Head    []byte      `json:"head,omitempty"`    // Unasked: the bytes read from it so far
	// Quiet is how long the tunnel had been quiet (quiet.go) when it was
	// paused, so that a drain of the next image finds an idle keep-alive
	// connection idle; 0: the last bytes came from the client.
	Quiet time.Duration `json:"quiet,omitempty"`
	// Until is how long a resume can succeed, which the next image waits
	// for the agent: the agent holds the destination for wire.ResumeWindow
	// from the pause, and its credential must still be trusted (a token's
	// expiry; docs/security.md). Zero: resumeWait.
	Until time.Time `json:"until,omitzero"`
}

// resumeUntil is PausedTunnel.Until of a tunnel through a paused now.
func resumeUntil(a *agentConn) time.Time {
	until := time.Now().Add(wire.ResumeWindow)
	if a.cred != nil {
		a.cred.mu.Lock()
		if exp := a.cred.expires; !exp.IsZero() && exp.Before(until) {
			until = exp
		}
		a.cred.mu.Unlock()
	}
	return until
}

// waitFor is how long the next image waits for p's agent.
func (p *PausedTunnel) waitFor() time.Duration {
	if p.Until.IsZero() {
		return resumeWait
	}
	return max(0, time.Until(p.Until))
}

// PausedGRPC is what resuming a gRPC front door call needs besides the
// tunnel: the call's connect ID, the part of a client message read before
// the pause, and the frozen HTTP/2 connection.
type PausedGRPC struct {
	ConnectID int64          `json:"connect_id"`
	Partial   []byte         `json:"partial,omitempty"`
	Link      *h2link.Frozen `json:"link"`
}

var errNotPausable = errors.New("tunnel cannot be paused")

// HandOver is Shutdown for a self-restart: before the drain it pauses
// every tunnel that can move to the next image without loss and returns
// them; the caller passes their sockets on, and the next image calls
// Resume. Tunnels that cannot move drain as with Shutdown.
func (s *Server) HandOver(ctx context.Context) ([]*PausedTunnel, error) {
	var paused []*PausedTunnel
	err := s.shutdown(ctx, func() func(context.Context) {
		todo := s.takeMovable(nil)
		paused = s.takeHeld(false) // still paused: passed on as they are
		s.metrics.restarts.paused[resultOK].Add(uint64(len(paused)))
		unasked := s.collectUnasked()
		return func(ctx context.Context) {
			paused = append(paused, unasked...)
			paused = append(paused, s.pauseAll(ctx, todo, "tunnels paused for the next image")...)
			paused = append(paused, s.collectAgentPauses()...)
		}
	})
	return paused, err
}

// takeUnaskedLocked moves every front-door connection still reading its
// client's head to passing: its goroutine, woken by leaving
// (interruptUnasked), passes it on as it is (passUnasked). Called in the
// same critical section that sets shutting, so each connection either
// asked before (pending, waited for) or is taken here. Server.mu is held.
func (s *Server) takeUnaskedLocked() {
	for t := range s.tunnels {
		if t.state == tunnelReading {
			t.moveLocked(tunnelPassing)
		}
	}
}

// interruptUnasked ends the head read of t once a handover took it.
func (s *Server) interruptUnasked(t *tunnel, conn net.Conn) {
	s.mu.Lock()
	taken := t.state == tunnelPassing
	s.mu.Unlock()
	if taken {
		conn.SetReadDeadline(time.Unix(1, 0))
	}
}

// asked moves t, whose head has been read (or failed), to dialing and
// counts its dial as pending; false when a handover took it first.
func (s *Server) asked(t *tunnel, pd *pendingDial) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if t.state != tunnelReading {
		return false
	}
	t.moveLocked(tunnelDialing)
	pd.ask()
	return true
}

// passUnasked passes t, taken by a handover before its client asked for
// anything (passing), on to the next image with the bytes read from it:
// a plain socket is left held, for the handover to collect (its goroutine
// leaves it open: leave); a TLS one is closed (its handshake cannot
// move), which loses nothing its client asked for.
func (s *Server) passUnasked(t *tunnel, conn net.Conn, seen []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	defer s.moved.Broadcast()
	if wire.RawSocket(conn) == nil || s.closed {
		t.moveLocked(tunnelClosed)
		s.log.Debug("front-door connection that asked for nothing closed by the restart")
		return
	}
	t.handed = &PausedTunnel{Socket: conn, Unasked: true, Head: seen}
	t.moveLocked(tunnelHeld)
}

// passDialing passes t on to the next image as a connection that asked
// for nothing yet, when a handover began while its dial waited for an
// agent: no agent was asked, and none can log in to a server that is
// leaving, so the next image, whose agents log in again, dials it. What
// its client sent goes with it: the head (head) and whatever came after
// it (br's buffer, once the upload's first read is stopped). False when
// the shutdown is not a handover, or the handover is past taking it.
func (s *Server) passDialing(t *tunnel, conn net.Conn, head []byte, br *bufio.Reader) bool {
	s.mu.Lock()
	ok := s.handingOver && !s.collected && !s.closed && t.moveLocked(tunnelPassing)
	s.mu.Unlock()
	if !ok {
		return false
	}
	t.up.unblock()
	<-t.up.peeked
	rest, _ := br.Peek(br.Buffered())
	s.log.Debug("dial waiting for an agent handed to the next image", "addr", t.addr)
	s.passUnasked(t, conn, append(slices.Clip(head), rest...))
	return true
}

// collectAgentPauses waits until no batch of pauses for an agent's
// restart is running (each tunnel's pause is bounded by pauseTimeout),
// and returns the tunnels they held while the server was shutting down,
// taken off the table: a tunnel paused for its agent's next image goes on
// to the server's next image, whichever restart came first.
func (s *Server) collectAgentPauses() []*PausedTunnel {
	s.mu.Lock()
	for s.agentPausing > 0 {
		s.moved.Wait()
	}
	out := s.takeHeldLocked(false)
	s.mu.Unlock()
	s.metrics.restarts.paused[resultOK].Add(uint64(len(out)))
	return out
}

// collectUnasked waits until no tunnel is passing (each taken connection
// is held, or closed), and returns the held unasked ones, taken off the
// table.
func (s *Server) collectUnasked() []*PausedTunnel {
	s.mu.Lock()
	s.collected = true
	for s.inState[tunnelPassing] > 0 {
		s.moved.Wait()
	}
	out := s.takeHeldLocked(true)
	s.mu.Unlock()
	if len(out) > 0 {
		s.log.Info("front-door connections that asked for nothing yet handed to the next image", "connections", len(out))
	}
	return out
}

// takeHeld takes the held tunnels off the table for a handover to pass
// on as they are: the unasked connections (unasked) or the paused tunnels
// waiting for their agent.
func (s *Server) takeHeld(unasked bool) []*PausedTunnel {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.takeHeldLocked(unasked)
}

// takeHeldLocked is takeHeld. Server.mu is held.
func (s *Server) takeHeldLocked(unasked bool) []*PausedTunnel {
	var out []*PausedTunnel
	for t := range s.tunnels {
		if t.state == tunnelHeld && t.handed.Unasked == unasked {
			out = append(out, t.handed)
			t.moveLocked(tunnelClosed)
		}
	}
	return out
}

// holdLocked puts p, a paused tunnel that waits for its agent to log in
// again, in the table held, and returns its entry, which no goroutine
// serves. Server.mu is held.
func (s *Server) holdLocked(p *PausedTunnel) *tunnel {
	t := &tunnel{front: heldFront{}, handed: p, state: tunnelHeld}
	s.enterLocked(t)
	return t
}

// dropHeldLocked closes a held tunnel's socket and takes it off the
// table: the server closes without a next image. Server.mu is held.
func (s *Server) dropHeldLocked(t *tunnel) {
	p := t.handed
	p.Socket.Close()
	t.moveLocked(tunnelClosed)
	if !p.Unasked {
		s.resumeFailed(p, resultFailed, errors.New("server closed before the agent was back"))
	}
}

// heldFront is the front of a held tunnel's entry that holdLocked made:
// its socket is the PausedTunnel's Socket, which only dropHeldLocked and the
// resume close, and nothing else reaches it, as a held tunnel is neither
// open nor served.
type heldFront struct{}

func (heldFront) closeQuiet(*tunnel)    {}
func (heldFront) unread() bool          { return false }
func (heldFront) hangup() net.Conn      { return nil }
func (heldFront) closeSocket()          {}
func (heldFront) pausable(*tunnel) bool { return false }
func (heldFront) pause(context.Context, *tunnel) (*PausedTunnel, error) {
	return nil, errNotPausable
}

// takeMovable moves every open tunnel (through agent of, or any when nil)
// that can be paused to pausing, which takes it off the quiet drain,
// before the drain closes any; the others are counted as not pausable.
func (s *Server) takeMovable(of *agentConn) []*tunnel {
	var todo []*tunnel
	refused := 0
	s.mu.Lock()
	for t := range s.tunnels {
		if t.state != tunnelOpen || of != nil && t.agent != of {
			continue
		}
		if t.agent.canPause && t.front.pausable(t) && t.moveLocked(tunnelPausing) {
			todo = append(todo, t)
		} else {
			refused++
		}
	}
	s.mu.Unlock()
	s.metrics.restarts.paused[resultNotPausable].Add(uint64(refused))
	return todo
}

// pauseAll pauses the tunnels takeMovable took, all at once, each on
// its own goroutine under its own pauseTimeout: a tunnel's chance does not
// depend on its place in a queue, so a tunnel whose client does not read,
// or whose agent never answers, costs no other tunnel its time; the ones
// that fail are closed, alone. What bounds the requests in flight on one
// agent's connection is its own stream limit, as for dials. event is the
// summary's log message.
func (s *Server) pauseAll(ctx context.Context, todo []*tunnel, event string) []*PausedTunnel {
	if len(todo) == 0 {
		return nil
	}
	var (
		mu     sync.Mutex
		paused []*PausedTunnel
		wg     sync.WaitGroup
	)
	for _, t := range todo {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pctx, cancel := context.WithTimeout(ctx, pauseTimeout)
			p, err := t.front.pause(pctx, t)
			cancel()
			s.metrics.restarts.paused[pauseResult(err)].Inc()
			if err != nil {
				s.log.Warn("tunnel could not be paused for the restart; closed", "addr", t.addr, "agent", t.agent.id, "err", err)
				return
			}
			mu.Lock()
			paused = append(paused, p)
			mu.Unlock()
		}()
	}
	wg.Wait()
	s.log.Info(event, "paused", len(paused), "failed", len(todo)-len(paused))
	return paused
}

// pausable: an HTTP CONNECT tunnel on a plain socket whose bytes flow both
// ways.
func (f *httpFront) pausable(t *tunnel) bool {
	down := t.down.Load()
	if down == nil {
		return false
	}
	select {
	case <-t.up.done:
		return false
	case <-down.Done():
		return false
	default:
		return true
	}
}

// pause pauses an HTTP CONNECT tunnel (steps 1 to 4 above). On failure
// the tunnel is closed. The socket itself goes on: once paused, the
// tunnel's goroutine leaves it open (leave).
func (f *httpFront) pause(ctx context.Context, t *tunnel) (p *PausedTunnel, err error) {
	defer func() {
		if err != nil {
			f.closeQuiet(t)
		}
	}()
	token, err := newResumeToken()
	if err != nil {
		return nil, err
	}
	// 1. Stop the upload where it is.
	t.up.stopping.Store(true)
	f.conn.SetReadDeadline(time.Now())
	if err := t.waitUploadStopped(ctx); err != nil {
		return nil, err
	}
	// 2 and 3. Ask the agent.
	agentSent, err := t.askPause(ctx, token)
	if err != nil {
		return nil, err
	}
	// 4. Let the client have every byte the agent sent.
	if err := t.down.Load().WaitWritten(ctx, agentSent); err != nil {
		return nil, fmt.Errorf("to the client: %w", err)
	}
	p = &PausedTunnel{Socket: f.conn, Addr: t.addr, Agent: t.agent.id, Token: token, Quiet: t.act.QuietFor(), Until: resumeUntil(t.agent)}
	t.move(tunnelPaused)
	t.endStream()
	return p, nil
}

// pausable: a call on a plain socket, alone on its connection
// (konnectivity-client dials one per tunnel), still sending.
func (f *grpcFront) pausable(t *tunnel) bool {
	return f.conn.link.Freezable() && f.conn.calls.Load() == 1 && !t.up.isDone()
}

// pause pauses a gRPC front door call: the same steps as an HTTP CONNECT
// tunnel, with the client's HTTP/2 connection stopped at a frame boundary
// (step 1), and frozen once the call let its stream go (step 4).
//
// The socket goes on as it is: the connection's goroutine leaves it open
// once kept (grpcConn.closeSocket).
func (f *grpcFront) pause(ctx context.Context, t *tunnel) (p *PausedTunnel, err error) {
	link := f.conn.link
	defer func() {
		if err != nil {
			f.conn.kept.Store(false)
			link.Close() // the call ends with the connection, as a drain's deadline would end it
			f.conn.socket.Close()
		}
	}()
	token, err := newResumeToken()
	if err != nil {
		return nil, err
	}
	// 1. Nothing more is read from the client; the upload sends what was.
	t.up.stopping.Store(true)
	if err := link.StopReading(ctx); err != nil {
		return nil, fmt.Errorf("stop reading the client: %w", err)
	}
	if err := t.waitUploadStopped(ctx); err != nil {
		return nil, err
	}
	// 2 and 3.
	agentSent, err := t.askPause(ctx, token)
	if err != nil {
		return nil, err
	}
	// 4. Every byte the agent sent goes to the client, then the call lets
	// its stream go and the connection is frozen.
	if err := t.down.Load().WaitWritten(ctx, agentSent); err != nil {
		return nil, fmt.Errorf("to the client: %w", err)
	}
	f.handedOn.Store(true)
	t.move(tunnelPaused)
	t.endStream()
	if err := link.WaitAtRest(ctx); err != nil {
		return nil, err
	}
	f.conn.kept.Store(true) // before the freeze ends the connection's goroutine
	frozen, err := link.Freeze()
	if err != nil {
		return nil, err
	}
	partial := append([]byte(nil), f.in.mr.Partial()...)
	return &PausedTunnel{Socket: f.conn.socket, Addr: t.addr, Agent: t.agent.id, Token: token, Quiet: t.act.QuietFor(), Until: resumeUntil(t.agent),
		GRPC: &PausedGRPC{ConnectID: f.connectID, Partial: partial, Link: frozen}}, nil
}

// waitUploadStopped waits for the upload to stop after step 1, every byte
// it read sent on.
func (t *tunnel) waitUploadStopped(ctx context.Context) error {
	select {
	case <-t.up.done:
	case <-ctx.Done():
		return fmt.Errorf("upload did not stop: %w", ctx.Err())
	}
	if !t.up.stopped {
		return errNotPausable // the client ended its upload meanwhile
	}
	return nil
}

// askPause asks the agent to pause t once the bytes sent on it reached the
// destination, and returns the bytes the agent sent on it.
func (t *tunnel) askPause(ctx context.Context, token string) (int64, error) {
	body := t.body.(*h2link.Body)
	req := (&http.Request{
		Method: http.MethodPost,
		URL:    &url.URL{Scheme: "https", Host: "agent", Path: wire.PausePath},
		Host:   "agent",
		Header: http.Header{
			wire.HdrPauseStream: {strconv.FormatUint(uint64(body.StreamID()), 10)},
			wire.HdrPauseSent:   {strconv.FormatInt(t.up.sent, 10)},
			wire.HdrResumeToken: {token},
		},
	}).WithContext(ctx)
	resp, err := t.agent.link.RoundTrip(req)
	if err != nil {
		return 0, fmt.Errorf("pause request: %w", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("agent refused the pause: %s", resp.Status)
	}
	agentSent, err := strconv.ParseInt(resp.Header.Get(wire.HdrPauseSent), 10, 64)
	if err != nil || agentSent < 0 {
		return 0, errors.New("agent's pause answer has no byte count")
	}
	return agentSent, nil
}

func newResumeToken() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("resume token: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// Resume carries on tunnels a previous image of this process paused: each
// waits for its agent to log in again (up to resumeWait) and continues on
// a new stream. Call it once the agent listener serves. A tunnel that
// cannot resume is closed, and logged.
//
// A tunnel waiting for its agent is held in the table: a restart that
// comes meanwhile passes it on to the next image as it is (takeHeld). From
// the agent's return until the tunnel is where a handover can pause it
// again, it counts as pending (Server.pending), as an accepted dial does,
// so that a restart waits for it rather than leaving it to the drain.
//
// An Unasked connection is served at once, as a new one.
func (s *Server) Resume(paused []*PausedTunnel) {
	held := make([]*tunnel, 0, len(paused))
	s.mu.Lock()
	for _, p := range paused {
		if !p.Unasked {
			held = append(held, s.holdLocked(p))
		}
	}
	s.mu.Unlock()
	for _, p := range paused {
		if p.Unasked {
			s.goroutine(func() { s.resumeUnasked(p) })
		}
	}
	for _, h := range held {
		s.goroutine(func() { s.resumeTunnel(h) })
	}
}

// resumeUnasked serves a connection the previous image took before its
// client asked for anything, as a new one that has already sent p.Head.
func (s *Server) resumeUnasked(p *PausedTunnel) {
	c := p.Socket
	c.SetDeadline(time.Time{}) // a pause may have left one
	t := newHTTPTunnel(c)
	t.state, t.handed = tunnelReading, p
	pd := &pendingDial{s: s}
	defer pd.release()
	s.serveFrontendConn(t, pd)
}

// resumeTunnel waits for the agent of h, a held tunnel, and carries it on
// as a new tunnel once the agent is back.
func (s *Server) resumeTunnel(h *tunnel) {
	p := h.handed
	wait := p.waitFor()
	a := s.waitAgentID(p.Agent, nil, wait)
	s.mu.Lock()
	if h.state != tunnelHeld || s.shutting {
		// A handover passes it on, or Close drops it.
		s.mu.Unlock()
		return
	}
	h.moveLocked(tunnelClosed) // the tunnel that carries it on enters below
	if a != nil {
		s.pending.Add(1) // under mu: a shutdown either waits for it or saw it waiting
	}
	s.mu.Unlock()
	if a == nil {
		p.Socket.Close()
		s.resumeFailed(p, resultTimeout, fmt.Errorf("agent not back within %s", wait.Round(time.Millisecond)))
		return
	}
	pd := &pendingDial{s: s}
	pd.v.Store(dialCounted)
	defer pd.release()
	c := p.Socket
	c.SetDeadline(time.Time{}) // a pause may have left one
	if p.GRPC != nil {
		s.resumeGRPC(c, p, pd)
		return
	}
	// The tunnel's own path is that of a new one, so that it parks as
	// shallow (see "Parked stacks" in doc.go).
	t := newHTTPTunnel(c)
	t.handed = p
	s.serveFrontendConn(t, pd)
}

func (s *Server) resumeFailed(p *PausedTunnel, result string, err error) {
	s.metrics.restarts.resumed[result].Inc()
	s.log.Warn("paused tunnel could not be resumed; client connection closed", "addr", p.Addr, "agent", p.Agent, "err", err)
}

// resumeGRPC rebuilds a gRPC front door connection whose call was paused
// and serves it: the call goes on as the one paused, and any call the
// client opens later is served as usual. pd is the resume's count as
// pending.
func (s *Server) resumeGRPC(conn net.Conn, p *PausedTunnel, pd *pendingDial) {
	if !s.enterGRPCConn() {
		conn.Close()
		return
	}
	c := &grpcConn{s: s, socket: conn, pend: pd}
	stop := context.AfterFunc(s.baseCtx, c.closeSocket)
	defer func() {
		stop()
		c.closeSocket()
		s.leaveGRPCConn()
	}()
	resumed := func(w http.ResponseWriter, r *http.Request) {
		if s.resumeGRPCCall(c, w, r, p) == errHandedOn {
			h2link.Detach(w)
		}
		// errHeld: the call's waiter ends it (waitGRPC)
	}
	h2conn := grpcLinkConn(conn)
	l, err := h2link.ResumeServer(h2conn, s.grpcLinkConfig(conn, h2conn, 0), p.GRPC.Link, c, resumed)
	if err != nil {
		s.resumeFailed(p, resultFailed, err)
		return
	}
	c.link = l
	l.Serve()
}

// resumeGRPCCall carries on a paused gRPC call: what DIAL_RSP set up is
// rebuilt, the agent is asked for the held destination, and the tunnel is
// carried as proxyGRPC carries it. If the tunnel cannot resume, the client
// is told as when the destination breaks (CLOSE_RSP with the error).
func (s *Server) resumeGRPCCall(c *grpcConn, w http.ResponseWriter, r *http.Request, p *PausedTunnel) error {
	c.calls.Add(1)
	s.metrics.grpcConns.Add(1)
	held := false // the call goes on after the handler returns: its waiter ends it
	defer func() {
		if !held {
			s.grpcCallLeft()
			c.callDone(false, true)
		}
	}()
	t := newGRPCTunnel(c, w, r)
	f := t.front.(*grpcFront)
	f.connectID, t.addr, t.handed, f.resumed = p.GRPC.ConnectID, p.Addr, p, true
	t.act.CarryQuiet(p.Quiet)
	if !s.enter(t) {
		c.pend.release()
		return nil
	}
	defer func() {
		if !held {
			s.leave(t)
		}
	}()
	s.initGRPCUpload(t, nil, p.GRPC.Partial)
	if err := s.resumeStream(t); err != nil {
		c.pend.release() // the connection is served on; the tunnel is not
		s.sendGRPC(f.g, grpcwire.Packet{Type: grpcwire.CloseRsp, ConnectID: f.connectID, Error: "tunnel lost in a server restart: " + wire.ErrMsg(err)})
		f.g.finish(grpcOK, "")
		return nil
	}
	code, msg, err := s.carryGRPC(t)
	switch err {
	case errHeld:
		held = true
		return err
	case errHandedOn:
		return err
	}
	f.g.finish(code, msg)
	return nil
}

// openHanded opens the stream that carries on t, a tunnel a previous
// image paused, through its agent; on failure it logs and returns false,
// and the client's connection is closed.
func (s *Server) openHanded(t *tunnel, conn net.Conn) bool {
	br := headReaders.Get().(*bufio.Reader)
	br.Reset(conn)
	s.initFrontendUpload(t, conn, br)
	t.addr = t.handed.Addr
	t.act.CarryQuiet(t.handed.Quiet)
	return s.resumeStream(t) == nil && t.move(tunnelOpen)
}

// resumeStream opens the stream that carries t.handed on through its
// agent, which resumeTunnel saw back; a failure is logged and counted, and
// the upload released.
func (s *Server) resumeStream(t *tunnel) error {
	p := t.handed
	a := s.agents.byID(p.Agent)
	err, result := errors.New("agent gone again before the tunnel resumed"), resultFailed
	for tries := 0; a != nil; tries++ {
		err = s.roundTrip(t, a, time.Now().Add(s.cfg.DialTimeout), p.Token)
		if !agentLeaving(err) || tries == maxAgentRestarts {
			break
		}
		if a = s.waitAgentID(p.Agent, a, p.waitFor()); a == nil {
			err, result = errors.New("agent restarted and not back while the tunnel could resume"), resultTimeout
		}
	}
	if err != nil {
		t.up.unblock()
		s.resumeFailed(p, result, err)
		return err
	}
	s.metrics.restarts.resumed[resultOK].Inc()
	s.log.Debug("tunnel resumed", "addr", p.Addr, "agent", p.Agent, "grpc", p.GRPC != nil)
	return nil
}

// Results of a pause and of a resume, the label of the handover metrics.
const (
	resultOK          = "ok"
	resultFailed      = "failed"
	resultTimeout     = "timeout"
	resultNotPausable = "not_pausable" // a pause only: the tunnel drained instead
)

// pauseResult is the result label of a pause that ended with err.
func pauseResult(err error) string {
	switch {
	case err == nil:
		return resultOK
	case errors.Is(err, errNotPausable):
		return resultNotPausable
	case errors.Is(err, context.DeadlineExceeded):
		return resultTimeout
	}
	return resultFailed
}

// restartMetrics count what a restart moved: tunnels paused here for the
// next image, and tunnels the next image resumed, by result.
type restartMetrics struct {
	paused, resumed map[string]*promtext.Counter // immutable maps of the results
}

func newRestartMetrics(m *promtext.Registry) restartMetrics {
	h := restartMetrics{paused: map[string]*promtext.Counter{}, resumed: map[string]*promtext.Counter{}}
	for _, r := range []string{resultOK, resultFailed, resultTimeout, resultNotPausable} {
		h.paused[r] = m.Counter(serverPrefix+"tunnels_paused_total", "Tunnels a restart paused to hand to the next image, by result (not_pausable: drained instead).", []string{"result"}, r)
	}
	for _, r := range []string{resultOK, resultFailed, resultTimeout} {
		h.resumed[r] = m.Counter(serverPrefix+"tunnels_resumed_total", "Tunnels a previous image paused and this one resumed, by result (timeout: the agent did not come back).", []string{"result"}, r)
	}
	return h
}

// RestartStatus counts the tunnels a restart paused here for the next
// image, and those this image resumed, by result (ok, failed, timeout,
// not_pausable); the same counts as the tunnels_paused_total and
// tunnels_resumed_total metrics.
type RestartStatus struct {
	Paused  map[string]uint64 `json:"paused"`
	Resumed map[string]uint64 `json:"resumed"`
}

// restartStatus is RestartStatus now.
func (s *Server) restartStatus() *RestartStatus {
	return &RestartStatus{Paused: counts(s.metrics.restarts.paused), Resumed: counts(s.metrics.restarts.resumed)}
}

// counts returns the counters by result, for status.
func counts(cs map[string]*promtext.Counter) map[string]uint64 {
	out := make(map[string]uint64, len(cs))
	for r, c := range cs {
		out[r] = c.Value()
	}
	return out
}

// waitAgentID returns the connected agent with id once it is there, or nil
// after wait or once the server shuts down: a shutdown waits for resumes
// (Server.pending), and must not wait for an agent that is not back. An
// agent restarting in place, or the connection not, is not the one
// waited for.
func (s *Server) waitAgentID(id string, not *agentConn, wait time.Duration) *agentConn {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		a, changed := s.agents.arrival(id, not)
		if a != nil {
			return a
		}
		if s.isShutting() {
			return nil
		}
		select {
		case <-changed:
		case <-timer.C:
			return nil
		case <-s.baseCtx.Done():
			return nil
		}
	}
}
