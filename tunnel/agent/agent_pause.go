package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// The agent's half of a handover (handover.go has the protocol): it pauses
// a tunnel when its server asks, keeps the destination connection open for
// wire.ResumeWindow under the token the server chose, and gives it to the
// CONNECT stream that names that token.

// pauseWait bounds how long the agent waits for the upload bytes the server
// says it sent to reach the destination before it gives the pause up.
const pauseWait = 5 * time.Second

// maxPaused bounds the destination connections an agent keeps paused.
const maxPaused = 10000

// pauseMeeting is where servePause and the carry of the tunnel it stops
// tell each other what they did. It exists only while the request runs,
// in Agent.pausing under the destination connection: nothing is
// registered per tunnel.
type pauseMeeting struct {
	// Immutable once registered.
	dest    net.Conn
	up      *h2link.Delivery // the server's bytes on their way to dest
	stopped chan struct{}    // closed by carry once it stopped reading dest
	settled chan struct{}    // closed by servePause once it decided

	// Written by carry before it closes stopped: the bytes it sent to the
	// server, or -1 when the download ended on its own instead.
	downSent int64
	// Written by servePause before it closes settled.
	paused bool // the destination is kept for a resume: carry lets the stream go
}

// keptDests is what the agent keeps for restarting servers; guarded by
// Agent.mu, but for inFlight.
type keptDests struct {
	byToken  map[string]*pausedDest     // destination connections kept for a resume, by token
	meetings map[net.Conn]*pauseMeeting // pause requests running, by destination
	count    int                        // destinations kept or being stopped
	inFlight atomic.Int32               // pause requests in flight: carry looks for its tunnel only then
}

// takeKeptFor answers a CONNECT stream that names a resume token with the
// destination kept under it: dest, or nil when the stream was answered
// with the failure. handled is false when the stream names no token.
func (a *Agent) takeKeptFor(w http.ResponseWriter, r *http.Request) (dest net.Conn, handled bool) {
	token := r.Header.Get(wire.HdrResumeToken)
	if token == "" {
		return nil, false
	}
	if a.isRestarting() {
		// The destination goes to the next image, which the server waits for.
		w.Header().Set(wire.HdrAgentRestarting, "1")
		http.Error(w, "agent restarting in place: the tunnel resumes on its next image", http.StatusServiceUnavailable)
		a.log.Debug("resume refused: restarting in place", "addr", r.Host)
		return nil, true
	}
	dest, err := a.takePaused(token)
	if err != nil {
		a.log.Info("tunnel not resumed", "addr", r.Host, "err", err)
		http.Error(w, wire.ErrMsg(err), wire.StatusCode(err))
		return nil, true
	}
	dest.SetReadDeadline(time.Time{})
	a.log.Debug("tunnel resumed", "addr", r.Host)
	return dest, true
}

// pausedDest is a destination connection kept for a resume.
type pausedDest struct {
	conn  net.Conn    // a duplicate of the tunnel's socket: the tunnel's own closes do not reach it
	until time.Time   // set by keepPaused: when it stops being kept
	timer *time.Timer // set under Agent.mu before the entry can be taken; ends the keeping
}

// servePause answers a server's pause request for one of its tunnels on
// this connection: once the bytes the server sent have reached the
// destination, the agent stops reading the destination, sends what it
// read, keeps the connection under the server's token and answers with the
// bytes it sent. Any other answer changes nothing, or (a
// download stuck on a server that does not read) ends it.
func (a *Agent) servePause(l *connToServer, w http.ResponseWriter, r *http.Request) {
	id, err1 := strconv.ParseUint(r.Header.Get(wire.HdrPauseStream), 10, 31)
	sent, err2 := strconv.ParseInt(r.Header.Get(wire.HdrPauseSent), 10, 64)
	token := r.Header.Get(wire.HdrResumeToken)
	if err1 != nil || err2 != nil || sent < 0 || !validToken(token) || len(token) > wire.MaxResumeToken {
		http.Error(w, "malformed pause request", http.StatusBadRequest)
		return
	}
	var dest net.Conn
	var up *h2link.Delivery
	if lk := l.link.Load(); lk != nil {
		dest, up = lk.Sink(uint32(id))
	}
	if dest == nil {
		http.Error(w, fmt.Sprintf("no open tunnel on stream %d", id), http.StatusNotFound)
		return
	}
	dup, err := wire.DupSocket(dest)
	if err != nil {
		http.Error(w, "destination cannot be kept: "+err.Error(), http.StatusConflict)
		return
	}
	t := &pauseMeeting{dest: dest, up: up, stopped: make(chan struct{}), settled: make(chan struct{})}
	if code, err := a.startPause(t); err != nil {
		dup.Close()
		http.Error(w, err.Error(), code)
		return
	}
	defer a.endPause(t)
	fail := func(code int, err error) {
		close(t.settled)
		dup.Close()
		http.Error(w, err.Error(), code)
	}
	// Every DATA frame the server sent before this request came first on
	// the connection; wait until the link has written them all.
	if err := waitDelivered(r, up, sent); err != nil {
		fail(http.StatusConflict, err)
		return
	}
	dest.SetReadDeadline(time.Now()) // carry stops reading: see downloadStopped
	select {
	case <-t.stopped:
	case <-time.After(pauseWait):
		// Stuck sending to the server, or the download ended before the
		// pause was registered: the tunnel cannot stop at a known point.
		fail(http.StatusConflict, fmt.Errorf("the download did not stop within %s", pauseWait))
		return
	}
	if t.downSent < 0 {
		fail(http.StatusConflict, errors.New("the destination ended the tunnel"))
		return
	}
	a.keepPaused(token, &pausedDest{conn: dup}, wire.ResumeWindow)
	t.paused = true
	close(t.settled)
	w.Header().Set(wire.HdrPauseSent, strconv.FormatInt(t.downSent, 10))
	w.WriteHeader(http.StatusOK)
	a.log.Debug("tunnel paused for a resume", "server_id", l.id, "stream", id)
}

// startPause registers t for its tunnel's carry to find, within the bound
// on kept destinations.
func (a *Agent) startPause(t *pauseMeeting) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.kept.meetings[t.dest] != nil {
		return http.StatusConflict, errors.New("tunnel is already being paused")
	}
	if a.kept.count >= maxPaused {
		return http.StatusServiceUnavailable, errors.New("too many paused tunnels")
	}
	if a.kept.meetings == nil {
		a.kept.meetings = make(map[net.Conn]*pauseMeeting)
	}
	a.kept.meetings[t.dest] = t
	a.kept.count++ // kept from here on; given back by endPause unless paused
	a.kept.inFlight.Add(1)
	return 0, nil
}

func (a *Agent) endPause(t *pauseMeeting) {
	a.mu.Lock()
	delete(a.kept.meetings, t.dest)
	if !t.paused {
		a.dropKeptLocked()
	}
	a.mu.Unlock()
	a.kept.inFlight.Add(-1)
}

// waitDelivered waits until up has written exactly sent bytes and still
// runs, or gives up after pauseWait.
func waitDelivered(r *http.Request, up *h2link.Delivery, sent int64) error {
	ctx, cancel := context.WithTimeout(r.Context(), pauseWait)
	defer cancel()
	if err := up.WaitWritten(ctx, sent); err != nil {
		return fmt.Errorf("to the destination: %w", err)
	}
	select {
	case <-up.Done():
		return errors.New("the upload ended")
	default:
		return nil
	}
}

// downloadStopped is carry's report, while some pause is in progress,
// that its reading of dest returned with n bytes sent. Without a pause of
// this tunnel it is false. With one, it says where it stopped and waits
// for servePause's decision: true means the destination is now kept for a
// resume, and carry must let its stream go (keptEnd). Apart from carry,
// whose frame stays on parked stacks; it looks for the tunnel only while
// some pause is in progress.
//
//go:noinline
func (a *Agent) downloadStopped(dest net.Conn, n int64, downErr error) bool {
	if a.kept.inFlight.Load() == 0 {
		return false
	}
	a.mu.Lock()
	t := a.kept.meetings[dest]
	a.mu.Unlock()
	if t == nil {
		return false
	}
	if errors.Is(downErr, os.ErrDeadlineExceeded) {
		t.downSent = n
	} else {
		t.downSent = -1
	}
	close(t.stopped)
	<-t.settled
	return t.paused
}

// keptEnd ends a paused tunnel's stream: once the server ended it (the
// server's client has every byte sent here by then; a reset from this side
// could overtake them), with a reset. Cold, as downloadStopped.
//
//go:noinline
func (a *Agent) keptEnd(r *http.Request, up *h2link.Delivery) {
	<-r.Context().Done()
	r.Body.Close()
	<-up.Done()
	a.countUpload(up)
	panic(http.ErrAbortHandler)
}

// keepPaused keeps p under token until a resume takes it or wait passes;
// then it is closed with a reset, so the destination sees a broken
// connection rather than a clean end.
func (a *Agent) keepPaused(token string, p *pausedDest, wait time.Duration) {
	p.until = time.Now().Add(wait)
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.kept.byToken == nil {
		a.kept.byToken = make(map[string]*pausedDest)
	}
	if old := a.kept.byToken[token]; old != nil { // a token used twice: the older one goes
		old.timer.Stop()
		abortConn(old.conn)
		a.dropKeptLocked()
	}
	a.kept.byToken[token] = p
	p.timer = time.AfterFunc(wait, func() {
		if a.takePausedIf(token, p) {
			a.log.Warn("paused tunnel was not resumed in time; destination connection closed", "dest", p.conn.RemoteAddr().String(), "waited", wait.String())
			abortConn(p.conn)
		}
	})
}

// takePaused removes and returns the connection kept under token, open
// from here on: the stream that takes it is counted in Stats.Tunnels
// already (takeTunnel), before it stops being kept here, so a drain
// (shutIfIdle) sees it in one count or the other.
func (a *Agent) takePaused(token string) (net.Conn, error) {
	a.mu.Lock()
	p := a.kept.byToken[token]
	if p != nil {
		delete(a.kept.byToken, token)
		a.dropKeptLocked() // open (Stats.Tunnels) before no longer kept: see shutIfIdle
	}
	a.mu.Unlock()
	if p == nil {
		return nil, wire.StatusErrorf(http.StatusNotFound, "no paused tunnel for this resume token (expired, or the agent restarted)")
	}
	p.timer.Stop()
	return p.conn, nil
}

func (a *Agent) takePausedIf(token string, p *pausedDest) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.kept.byToken[token] != p {
		return false
	}
	delete(a.kept.byToken, token)
	a.dropKeptLocked()
	return true
}

// dropKeptLocked counts one kept destination gone. The caller holds a.mu.
func (a *Agent) dropKeptLocked() {
	a.kept.count--
	if a.kept.count == 0 {
		a.pokeIdle()
	}
}

// keptCount is how many destinations are kept for a resume or being paused.
func (a *Agent) keptCount() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.kept.count
}

// releaseKept closes every kept destination: the agent is stopping.
func (a *Agent) releaseKept() {
	a.mu.Lock()
	kept := a.kept.byToken
	a.kept.byToken = nil
	a.kept.count = 0
	a.mu.Unlock()
	for _, p := range kept {
		p.timer.Stop()
		abortConn(p.conn)
	}
}

// abortConn closes c with a reset when it is TCP.
func abortConn(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	c.Close()
}
