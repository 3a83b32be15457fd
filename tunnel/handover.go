package tunnel

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
	"os"
	"strconv"
	"sync"
	"time"

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
//     byte it read (the stream stays open: h2link.ErrUploadPaused).
//  2. It asks the agent, on a new stream of the same connection:
//     POST pausePath with the tunnel's stream ID, the bytes it sent on the
//     tunnel, and a resume token it chose.
//  3. The agent waits until those bytes reached the destination, stops
//     reading the destination, sends what it read, keeps the destination
//     connection under the token (resumeWindow) and answers 200 with the
//     bytes it sent.
//  4. The server waits until those bytes reached the client, ends the old
//     stream, and keeps a duplicate of the client's socket for the next
//     image. Bytes either side sends meanwhile wait in the kernel.
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
// with both directions open. Everything else drains as before (quiet.go),
// and a pause that fails at any step closes its tunnel, as a drain's
// deadline would.
const (
	pausePath      = "/konnectivity/v1/pause"
	hdrPauseStream = "Konnectivity-Pause-Stream" // the tunnel's stream ID
	hdrPauseSent   = "Konnectivity-Pause-Sent"   // bytes the sender sent on the tunnel
	hdrResumeToken = "Konnectivity-Resume-Token" // names a paused tunnel
	maxResumeToken = 64
)

// resumeWait bounds how long the next image waits for a paused tunnel's
// agent to log in again; less than the agent's resumeWindow.
const resumeWait = 20 * time.Second

// pauseTimeout bounds one tunnel's pause.
const pauseTimeout = 5 * time.Second

// pauseWorkers bounds the pauses in flight at once.
const pauseWorkers = 32

// PausedTunnel is a frontend tunnel paused for the next image of this
// process: the client's socket and what resuming it needs.
// All but File travel to the next image as JSON.
type PausedTunnel struct {
	File  *os.File    `json:"-"`              // a duplicate of the client's socket, close-on-exec set
	Addr  string      `json:"addr"`           // the destination, as the client asked for it
	Agent string      `json:"agent"`          // the agent holding the destination connection
	Token string      `json:"token"`          // the resume token the agent holds it under
	GRPC  *PausedGRPC `json:"grpc,omitempty"` // set for a gRPC front door call
}

var errNotPausable = errors.New("tunnel cannot be paused")

// pausable reports whether t can be paused: an HTTP CONNECT tunnel on a
// plain socket, through an agent that pauses, both directions open.
func (t *quietTunnel) pausable() bool {
	if t.st == nil || !t.st.agent.canPause {
		return false
	}
	if t.grpc != nil {
		return t.grpc.link.Freezable() && !t.up.isDone() // freezable: a plain socket
	}
	if t.up.down.Load() == nil {
		return false
	}
	select {
	case <-t.up.done:
		return false
	case <-t.up.down.Load().Done():
		return false
	default:
		return true
	}
}

// PausedGRPC is what resuming a gRPC front door call needs besides the
// tunnel: the call's connect ID, the part of a client message read before
// the pause, and the frozen HTTP/2 connection.
type PausedGRPC struct {
	ConnectID int64          `json:"connect_id"`
	Partial   []byte         `json:"partial,omitempty"`
	Link      *h2link.Frozen `json:"link"`
}

// takePausable takes every pausable tunnel off the drain, before the drain
// closes any.
func (s *Server) takePausable() []*quietTunnel {
	var todo []*quietTunnel
	s.mu.Lock()
	for act, t := range s.quietTunnels {
		if t.pausable() {
			delete(s.quietTunnels, act)
			todo = append(todo, t)
		}
	}
	s.mu.Unlock()
	return todo
}

// pauseAll pauses the tunnels takePausable took; the ones that fail are
// closed.
func (s *Server) pauseAll(ctx context.Context, todo []*quietTunnel) []*PausedTunnel {
	if len(todo) == 0 {
		return nil
	}
	var (
		mu     sync.Mutex
		paused []*PausedTunnel
		wg     sync.WaitGroup
		next   = make(chan *quietTunnel)
	)
	for range min(pauseWorkers, len(todo)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for t := range next {
				pause := s.pauseTunnel
				if t.grpc != nil {
					pause = s.pauseGRPCTunnel
				}
				p, err := pause(ctx, t)
				if err != nil {
					s.Stats.PauseFailed.Add(1)
					s.log.Warn("tunnel could not be paused for the restart; closed", "addr", t.up.addr, "agent", t.st.agent.id, "err", err)
					continue
				}
				mu.Lock()
				paused = append(paused, p)
				mu.Unlock()
			}
		}()
	}
	for _, t := range todo {
		next <- t
	}
	close(next)
	wg.Wait()
	s.Stats.Paused.Add(int64(len(paused)))
	s.log.Info("tunnels paused for the next image", "paused", len(paused), "failed", len(todo)-len(paused))
	return paused
}

// pauseTunnel pauses one tunnel (steps 1 to 4 above). On failure the
// tunnel is closed.
func (s *Server) pauseTunnel(ctx context.Context, t *quietTunnel) (p *PausedTunnel, err error) {
	ctx, cancel := context.WithTimeout(ctx, pauseTimeout)
	defer cancel()
	up, st, conn := t.up, t.st, t.conn
	// The duplicate is taken first: once the stream ends, the tunnel's
	// goroutine closes its own descriptor.
	f, err := dupSocketFile(conn)
	if err != nil {
		t.closeQuiet()
		return nil, err
	}
	defer func() {
		if err != nil {
			f.Close()
			t.closeQuiet()
		}
	}()
	token, err := newResumeToken()
	if err != nil {
		return nil, err
	}
	// 1. Stop the upload where it is.
	up.pausing.Store(true)
	conn.SetReadDeadline(time.Now())
	select {
	case <-up.done:
	case <-ctx.Done():
		return nil, fmt.Errorf("upload did not stop: %w", ctx.Err())
	}
	if !up.paused {
		return nil, errNotPausable // the client ended its upload meanwhile
	}
	// 2 and 3. Ask the agent.
	agentSent, err := s.askPause(ctx, st, up.sent, token)
	if err != nil {
		return nil, err
	}
	// 4. Let the client have every byte the agent sent.
	down := up.down.Load()
	for {
		written, _ := down.Result()
		if written == agentSent {
			break
		}
		select {
		case <-down.Done():
			if written, _ = down.Result(); written != agentSent {
				return nil, fmt.Errorf("delivery ended at %d of %d bytes", written, agentSent)
			}
		case <-ctx.Done():
			return nil, fmt.Errorf("client took %d of %d bytes: %w", written, agentSent, ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
	st.close()
	return &PausedTunnel{File: f, Addr: t.up.addr, Agent: st.agent.id, Token: token}, nil
}

// askPause asks the agent to pause the tunnel on st once the sent bytes
// reached the destination, and returns the bytes the agent sent on it.
func (s *Server) askPause(ctx context.Context, st *stream, sent int64, token string) (int64, error) {
	body := st.body.(*h2link.Body)
	req := (&http.Request{
		Method: http.MethodPost,
		URL:    &url.URL{Scheme: "https", Host: "agent", Path: pausePath},
		Host:   "agent",
		Header: http.Header{
			hdrPauseStream: {strconv.FormatUint(uint64(body.StreamID()), 10)},
			hdrPauseSent:   {strconv.FormatInt(sent, 10)},
			hdrResumeToken: {token},
		},
	}).WithContext(ctx)
	resp, err := st.agent.link.RoundTrip(req)
	if err != nil {
		return 0, fmt.Errorf("pause request: %w", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("agent refused the pause: %s", resp.Status)
	}
	agentSent, err := strconv.ParseInt(resp.Header.Get(hdrPauseSent), 10, 64)
	if err != nil || agentSent < 0 {
		return 0, errors.New("agent's pause answer has no byte count")
	}
	return agentSent, nil
}

// pauseGRPCTunnel pauses a gRPC front door call: the same steps as
// pauseTunnel, with the client's HTTP/2 connection stopped at a frame
// boundary (step 1), and frozen once the call let its stream go (step 4).
// A connection carries one call (konnectivity-client dials one per
// tunnel); one with more is not paused.
func (s *Server) pauseGRPCTunnel(ctx context.Context, t *quietTunnel) (p *PausedTunnel, err error) {
	ctx, cancel := context.WithTimeout(ctx, pauseTimeout)
	defer cancel()
	gt, st, up := t.grpc, t.st, t.up
	f, err := dupSocketFile(gt.conn)
	if err != nil {
		gt.link.Close()
		return nil, err
	}
	defer func() {
		if err != nil {
			f.Close()
			gt.link.Close() // the call ends with the connection, as a drain's deadline would end it
		}
	}()
	token, err := newResumeToken()
	if err != nil {
		return nil, err
	}
	// 1. Nothing more is read from the client; the upload sends what was.
	up.pausing.Store(true)
	if err := gt.link.StopReading(ctx); err != nil {
		return nil, fmt.Errorf("stop reading the client: %w", err)
	}
	select {
	case <-up.done:
	case <-ctx.Done():
		return nil, fmt.Errorf("upload did not stop: %w", ctx.Err())
	}
	if !up.paused {
		return nil, errNotPausable // the call ended meanwhile
	}
	// 2 and 3.
	agentSent, err := s.askPause(ctx, st, up.sent, token)
	if err != nil {
		return nil, err
	}
	// 4. Every byte the agent sent goes to the client, then the call lets
	// its stream go and the connection is frozen.
	for gt.downSent.Load() != agentSent {
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("client took %d of %d bytes: %w", gt.downSent.Load(), agentSent, ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
	gt.pausing.Store(true)
	st.close()
	var frozen *h2link.Frozen
	for {
		if frozen, err = gt.link.Freeze(); err == nil {
			break
		}
		if !errors.Is(err, h2link.ErrNotAtRest) {
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: %w", err, ctx.Err())
		case <-time.After(time.Millisecond):
		}
	}
	partial := append([]byte(nil), gt.in.mr.Partial()...)
	return &PausedTunnel{File: f, Addr: gt.addr, Agent: st.agent.id, Token: token,
		GRPC: &PausedGRPC{ConnectID: gt.connectID, Partial: partial, Link: frozen}}, nil
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
// Each counts as pending (Server.pending) until its tunnel is where a
// handover can pause it again, as an accepted dial does: a restart that
// comes while a resume is under way must find the tunnel to pause, not
// leave it to the drain, which closes a keep-alive connection.
func (s *Server) Resume(paused []*PausedTunnel) {
	for _, p := range paused {
		s.pending.Add(1)
		var once sync.Once
		release := func() { once.Do(func() { s.pending.Add(-1) }) }
		s.goroutine(func() {
			defer release()
			s.resumeTunnel(p, release)
		})
	}
}

func (s *Server) resumeTunnel(p *PausedTunnel, release func()) {
	c, err := net.FileConn(p.File)
	p.File.Close()
	if err != nil {
		s.Stats.ResumeFailed.Add(1)
		s.log.Warn("paused tunnel's socket unusable", "addr", p.Addr, "err", err)
		return
	}
	if p.GRPC != nil {
		if !s.trackFrontend(c, true) {
			c.Close()
			return
		}
		defer func() {
			s.trackFrontend(c, false)
			c.Close()
		}()
		s.resumeGRPC(c, p, release)
		return
	}
	s.addResume(c, p)
	s.serveFrontendConn(c, release)
}

// addResume marks c as the socket of paused tunnel p, for
// openFrontendTunnel; the tunnel's own path is then that of a new one, so
// that it parks as shallow (see "Parked stacks" in doc.go).
func (s *Server) addResume(c net.Conn, p *PausedTunnel) {
	s.mu.Lock()
	if s.resumes == nil {
		s.resumes = make(map[net.Conn]*PausedTunnel)
	}
	s.resumes[c] = p
	s.mu.Unlock()
	s.resuming.Add(1)
}

// takeResume returns the paused tunnel c is the socket of, once.
//
//go:noinline
func (s *Server) takeResume(c net.Conn) *PausedTunnel {
	s.mu.Lock()
	p := s.resumes[c]
	delete(s.resumes, c)
	s.mu.Unlock()
	if p != nil {
		s.resuming.Add(-1)
	}
	return p
}

func (s *Server) resumeFailed(p *PausedTunnel, err error) {
	s.Stats.ResumeFailed.Add(1)
	s.log.Warn("paused tunnel could not be resumed; client connection closed", "addr", p.Addr, "agent", p.Agent, "err", err)
}

// resumeGRPC rebuilds a gRPC front door connection whose call was paused
// and serves it: the call goes on as the one paused, and any call the
// client opens later is served as usual. release ends the resume's count
// as pending.
func (s *Server) resumeGRPC(c net.Conn, p *PausedTunnel, release func()) {
	var l *h2link.Conn
	h2conn := grpcLinkConn(c)
	resumed := func(w http.ResponseWriter, r *http.Request) {
		if s.resumeGRPCCall(l, c, w, r, p, release) == errTunnelPaused {
			h2link.Detach(w)
		}
	}
	l, err := h2link.ResumeServer(h2conn, s.grpcLinkConfig(c, h2conn, 0), p.GRPC.Link, s.grpcHandler(&l, c, func() {}, nil), resumed)
	if err != nil {
		s.resumeFailed(p, err)
		return
	}
	l.Serve()
}

// resumeGRPCCall carries on a paused gRPC call: what DIAL_RSP set up is
// rebuilt, the agent is asked for the held destination, and the tunnel is
// carried as proxyGRPC carries it. If the tunnel cannot resume, the client
// is told as when the destination breaks (CLOSE_RSP with the error).
func (s *Server) resumeGRPCCall(l *h2link.Conn, c net.Conn, w http.ResponseWriter, r *http.Request, p *PausedTunnel, release func()) error {
	s.Stats.FrontendOpen.Add(1)
	s.metrics.grpcConns.Add(1)
	defer func() {
		s.metrics.grpcConns.Add(-1)
		s.Stats.FrontendOpen.Add(-1)
	}()
	g := &grpcStream{w: w, flush: flusherOf(w)}
	t := &grpcTunnel{link: l, conn: c, ctx: r.Context(), g: g, body: r.Body, connectID: p.GRPC.ConnectID, addr: p.Addr, release: release}
	s.newGRPCUpload(t, nil, p.GRPC.Partial)
	var err error
	if t.st, err = s.resumeStream(p, t.up); err != nil {
		release() // the connection is served on; the tunnel is not
		s.sendGRPC(g, grpcwire.Packet{Type: grpcwire.CloseRsp, ConnectID: t.connectID, Error: "tunnel lost in a server restart: " + errMsg(err)})
		g.finish(grpcOK, "")
		return nil
	}
	code, msg, err := s.carryGRPC(t)
	if err == errTunnelPaused {
		return err
	}
	g.finish(code, msg)
	return nil
}

// openResumed opens the stream that resumes p through its agent; on
// failure it logs and returns nil, and the client's connection is closed.
func (s *Server) openResumed(c net.Conn, p *PausedTunnel) (*stream, *upload) {
	br := headReaders.Get().(*bufio.Reader)
	br.Reset(c)
	up := s.newFrontendUpload(c, br)
	up.addr = p.Addr
	st, err := s.resumeStream(p, up)
	if err != nil {
		return nil, nil
	}
	return st, up
}

// resumeStream waits for p's agent and opens the stream that resumes p,
// with up as its upload; a failure is logged and counted, and up released.
func (s *Server) resumeStream(p *PausedTunnel, up *upload) (*stream, error) {
	a := s.waitAgentID(p.Agent, resumeWait)
	var st *stream
	err := fmt.Errorf("agent not back within %s, or the server shut down first", resumeWait)
	if a != nil {
		st, err = s.roundTrip(a, p.Addr, up, time.Now().Add(s.cfg.DialTimeout), p.Token)
	}
	if err != nil {
		up.unblock()
		s.resumeFailed(p, err)
		return nil, err
	}
	s.established(st, a, up)
	s.Stats.Resumed.Add(1)
	s.log.Debug("tunnel resumed", "addr", p.Addr, "agent", p.Agent, "grpc", p.GRPC != nil)
	return st, nil
}

// waitAgentID returns the connected agent with id once it is there, or nil
// after wait or once the server shuts down: a shutdown waits for resumes
// (Server.pending), and must not wait for an agent that is not back.
func (s *Server) waitAgentID(id string, wait time.Duration) *agentConn {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		changed := s.agents.waitChan()
		for _, a := range s.agents.snapshot() {
			if a.id == id && a.canPause {
				return a
			}
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
