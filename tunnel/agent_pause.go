package tunnel

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
	"golang.org/x/sys/unix"
)

// The agent's half of a handover (handover.go has the protocol): it pauses
// a tunnel when its server asks, keeps the destination connection open for
// resumeWindow under the token the server chose, and gives it to the
// CONNECT stream that names that token.

// resumeWindow is how long a paused destination connection waits for its
// tunnel to resume: long enough for a server to re-execute and the agent to
// log in again (about a second), short enough that a server that never
// comes back does not hold a kubelet's or webhook's connection for long.
const resumeWindow = 30 * time.Second

// pauseWait bounds how long the agent waits for the upload bytes the server
// says it sent to reach the destination before it gives the pause up.
const pauseWait = 5 * time.Second

// maxPaused bounds the destination connections an agent holds paused.
const maxPaused = 10000

// Tunnel states on the agent, in agentTunnel.state.
const (
	tunnelCarrying int32 = iota // bytes flow both ways
	tunnelPausing               // a pause request is stopping the download
	tunnelPaused                // the destination connection is held for a resume
	tunnelEnded                 // the download ended on its own: no pause any more
)

// agentTunnel is one tunnel a server may pause: what servePause needs to
// stop it at a byte-exact point.
type agentTunnel struct {
	// Immutable once registered in serverConn.tunnels.
	dest net.Conn
	addr string           // the address dialled
	up   *h2link.Delivery // the server's bytes on their way to dest

	state atomic.Int32 // tunnelCarrying, tunnelPausing or tunnelPaused
	// Set by servePause before state becomes tunnelPausing, read by carry
	// after it sees tunnelPausing.
	stopped chan struct{} // closed by carry once it stopped reading dest
	settled chan struct{} // closed by servePause once it decided
	// Written by carry before it closes stopped: the bytes it sent to the
	// server, or -1 when the download ended on its own instead.
	downSent int64
}

// pausedDest is a destination connection held for a resume.
type pausedDest struct {
	conn  net.Conn // a duplicate of the tunnel's socket: the tunnel's own closes do not reach it
	addr  string   // the address dialled, which a resume must name
	timer *time.Timer
}

// pausable registers a tunnel its server may pause, on the link's stream
// ID; nil when the stream is not on a link (nothing to pause).
func (a *Agent) pausable(l *serverConn, r *http.Request, dest net.Conn, up *h2link.Delivery) *agentTunnel {
	b, ok := r.Body.(*h2link.Body)
	if !ok || l == nil {
		return nil
	}
	t := &agentTunnel{dest: dest, addr: r.Host, up: up}
	l.mu.Lock()
	if l.tunnels == nil {
		l.tunnels = make(map[uint32]*agentTunnel)
	}
	l.tunnels[b.StreamID()] = t
	l.mu.Unlock()
	return t
}

func (l *serverConn) removeTunnel(id uint32) {
	l.mu.Lock()
	delete(l.tunnels, id)
	l.mu.Unlock()
}

func (l *serverConn) tunnel(id uint32) *agentTunnel {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.tunnels[id]
}

// servePause answers a server's pause request for one of its tunnels on
// this connection: once the bytes the server sent have reached the
// destination, the agent stops reading the destination, sends what it
// read, holds the connection under the server's token and answers with the
// bytes it sent. Any other answer leaves the tunnel as it was.
func (a *Agent) servePause(l *serverConn, w http.ResponseWriter, r *http.Request) {
	id, err1 := strconv.ParseUint(r.Header.Get(hdrPauseStream), 10, 31)
	sent, err2 := strconv.ParseInt(r.Header.Get(hdrPauseSent), 10, 64)
	token := r.Header.Get(hdrResumeToken)
	if err1 != nil || err2 != nil || sent < 0 || !validToken(token) || len(token) > maxResumeToken {
		http.Error(w, "malformed pause request", http.StatusBadRequest)
		return
	}
	t := l.tunnel(uint32(id))
	if t == nil {
		http.Error(w, fmt.Sprintf("no open tunnel on stream %d", id), http.StatusNotFound)
		return
	}
	dup, err := dupSocket(t.dest)
	if err != nil {
		http.Error(w, "destination cannot be held: "+err.Error(), http.StatusConflict)
		return
	}
	if !a.reservePaused() {
		dup.Close()
		http.Error(w, "too many paused tunnels", http.StatusServiceUnavailable)
		return
	}
	t.stopped, t.settled = make(chan struct{}), make(chan struct{})
	if !t.state.CompareAndSwap(tunnelCarrying, tunnelPausing) {
		a.unreservePaused()
		dup.Close()
		http.Error(w, "tunnel is already being paused", http.StatusConflict)
		return
	}
	// Every DATA frame the server sent before this request came first on
	// the connection; wait until the link has written them all.
	if err := waitDelivered(r, t.up, sent); err != nil {
		t.state.Store(tunnelCarrying)
		close(t.settled)
		a.unreservePaused()
		dup.Close()
		http.Error(w, err.Error(), http.StatusConflict)
		return
	}
	t.dest.SetReadDeadline(time.Now()) // carry stops reading: see carry
	<-t.stopped
	if t.downSent < 0 {
		// The destination ended first: the tunnel ends as it would have.
		t.state.Store(tunnelEnded)
		close(t.settled)
		a.unreservePaused()
		dup.Close()
		http.Error(w, "the destination ended the tunnel", http.StatusConflict)
		return
	}
	a.holdPaused(token, &pausedDest{conn: dup, addr: t.addr})
	t.state.Store(tunnelPaused)
	close(t.settled)
	w.Header().Set(hdrPauseSent, strconv.FormatInt(t.downSent, 10))
	w.WriteHeader(http.StatusOK)
	a.log.Debug("tunnel paused for a resume", "server_id", l.id, "stream", id)
}

// waitDelivered waits until up has written sent bytes, or gives up.
func waitDelivered(r *http.Request, up *h2link.Delivery, sent int64) error {
	deadline := time.Now().Add(pauseWait)
	for {
		written, _ := up.Result()
		switch {
		case written == sent:
			select {
			case <-up.Done():
				return errors.New("the upload ended")
			default:
				return nil
			}
		case written > sent:
			return fmt.Errorf("the destination got %d bytes, the server says it sent %d", written, sent)
		}
		select {
		case <-up.Done():
			return errors.New("the upload ended")
		case <-r.Context().Done():
			return r.Context().Err()
		case <-time.After(time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d bytes reached the destination in %s", written, sent, pauseWait)
		}
	}
}

// downloadStopped is carry's report that its reading of the destination
// returned with n bytes sent. Without a pause in progress the tunnel can no
// longer be paused. With one, it says where it stopped and waits for
// servePause's decision: paused means the destination is now held for a
// resume, and carry must end its stream with a reset and touch nothing.
func (t *agentTunnel) downloadStopped(n int64, downErr error) (paused bool) {
	if t == nil || t.state.CompareAndSwap(tunnelCarrying, tunnelEnded) {
		return false
	}
	if errors.Is(downErr, os.ErrDeadlineExceeded) {
		t.downSent = n
	} else {
		t.downSent = -1
	}
	close(t.stopped)
	<-t.settled
	return t.state.Load() == tunnelPaused
}

func (a *Agent) reservePaused() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.pausedCount >= maxPaused {
		return false
	}
	a.pausedCount++
	return true
}

func (a *Agent) unreservePaused() {
	a.mu.Lock()
	a.pausedCount--
	a.mu.Unlock()
}

// holdPaused keeps p under token until a resume takes it or resumeWindow
// passes; then it is closed with a reset, so the destination sees a broken
// connection rather than a clean end.
func (a *Agent) holdPaused(token string, p *pausedDest) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.paused == nil {
		a.paused = make(map[string]*pausedDest)
	}
	if old := a.paused[token]; old != nil { // a token used twice: the older one goes
		old.timer.Stop()
		abortConn(old.conn)
		a.pausedCount--
	}
	a.paused[token] = p
	p.timer = time.AfterFunc(resumeWindow, func() {
		if a.takePausedIf(token, p) {
			a.log.Warn("paused tunnel was not resumed in time; destination connection closed", "addr", p.addr, "waited", resumeWindow.String())
			abortConn(p.conn)
		}
	})
}

// takePaused removes and returns the connection held under token for addr.
func (a *Agent) takePaused(token, addr string) (net.Conn, error) {
	a.mu.Lock()
	p := a.paused[token]
	if p != nil && p.addr == addr {
		delete(a.paused, token)
		a.pausedCount--
	}
	a.mu.Unlock()
	switch {
	case p == nil:
		return nil, statusErrorf(http.StatusNotFound, "no paused tunnel for this resume token (expired, or the agent restarted)")
	case p.addr != addr:
		return nil, statusErrorf(http.StatusBadRequest, "the paused tunnel goes to another address")
	}
	p.timer.Stop()
	return p.conn, nil
}

func (a *Agent) takePausedIf(token string, p *pausedDest) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.paused[token] != p {
		return false
	}
	delete(a.paused, token)
	a.pausedCount--
	return true
}

// closePaused closes every held destination: the agent is stopping.
func (a *Agent) closePaused() {
	a.mu.Lock()
	held := a.paused
	a.paused = nil
	a.pausedCount = 0
	a.mu.Unlock()
	for _, p := range held {
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

// dupSocket returns a second connection on c's socket (a plain TCP or Unix
// socket), with close-on-exec set: closing either leaves the other working.
func dupSocket(c net.Conn) (net.Conn, error) {
	f, err := dupSocketFile(c)
	if err != nil {
		return nil, err
	}
	defer f.Close() // FileConn holds its own duplicate
	return net.FileConn(f)
}

// dupSocketFile duplicates c's descriptor, close-on-exec set.
func dupSocketFile(c net.Conn) (*os.File, error) {
	raw := rawSocket(c)
	if raw == nil {
		return nil, errors.New("not a plain socket")
	}
	fd := -1
	var dupErr error
	if err := raw.Control(func(s uintptr) { fd, dupErr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 3) }); err != nil {
		return nil, err
	}
	if dupErr != nil {
		return nil, os.NewSyscallError("fcntl", dupErr)
	}
	return os.NewFile(uintptr(fd), "tunnel"), nil
}
