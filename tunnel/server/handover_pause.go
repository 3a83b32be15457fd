package server

// The pause part of the handover: steps 1 to 4 of the protocol
// (docs/restart.md, "The handover"), each tunnel on its own under its own
// pauseTimeout. On the gRPC front door step 1 also stops reading the
// client's HTTP/2 connection at a frame boundary, and step 4 freezes it
// (h2link.Frozen) once the call let its stream go; the part of a gRPC
// message read before the stop travels with it (PausedGRPC). Only what
// can move without loss is paused: a tunnel on a plain socket, through an
// agent that announced the pause feature, with both directions open,
// alone on its connection; the rest drains (quiet.go), and a pause that
// fails closes its tunnel.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// pauseTimeout bounds one tunnel's pause.
const pauseTimeout = 5 * time.Second

var errNotPausable = errors.New("tunnel cannot be paused")

// takeMovable moves every open tunnel (through agent of, or any when nil)
// that can be paused to pausing, which takes it off the quiet drain,
// before the drain closes any; the others are counted as not pausable.
func (h *handover) takeMovable(of *agentConn) []*tunnel {
	s := h.s
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
	h.metrics.paused[resultNotPausable].Add(uint64(refused))
	return todo
}

// pauseAll pauses the tunnels takeMovable took, all at once, each on
// its own goroutine under its own pauseTimeout: a tunnel's chance does not
// depend on its place in a queue, so a tunnel whose client does not read,
// or whose agent never answers, costs no other tunnel its time; the ones
// that fail are closed, alone. What bounds the requests in flight on one
// agent's connection is its own stream limit, as for dials. event is the
// summary's log message.
func (h *handover) pauseAll(ctx context.Context, todo []*tunnel, event string) []*PausedTunnel {
	s := h.s
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
			h.metrics.paused[pauseResult(err)].Inc()
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

// pause pauses an HTTP CONNECT tunnel (steps 1 to 4 of docs/restart.md). On failure
// the tunnel is closed. The socket itself goes on: once paused, the
// tunnel's goroutine does not close it (leave).
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
// The socket goes on as it is: the connection's goroutine does not close
// it once it is handed over (grpcConn.closeSocket).
func (f *grpcFront) pause(ctx context.Context, t *tunnel) (p *PausedTunnel, err error) {
	link := f.conn.link
	defer func() {
		if err != nil {
			f.conn.handedOver.Store(false)
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
	f.conn.handedOver.Store(true) // before the freeze ends the connection's goroutine
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
	resp, err := t.agent.ourLink().RoundTrip(req) // a pausable tunnel's agent is ours
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
