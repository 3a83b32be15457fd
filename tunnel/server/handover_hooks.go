package server

import (
	"bufio"
	"context"
	"net"
	"slices"
	"time"

	"github.com/spinifex/konnectivity/tunnel/wire"
)

// The front doors reach the handover only through these hooks, one for
// each moment of a tunnel's life at which a restart may take it
// (docs/restart.md):
//
//   - a connection that asked for nothing yet: headStarted while its
//     CONNECT head is read, headRead once it is (headSoFar: what it sent
//     before a previous image passed it on);
//   - a dial in flight that no agent took yet: dialWaiting;
//   - a tunnel just opened, whose agent may be restarting: opened;
//   - a tunnel a previous image handed over, resumed: handedIn.
//
// Everything else a restart does to a front door's tunnel goes through
// the front interface (pausable, pause: handover_pause.go).

// headStarted watches a connection that asked for nothing yet while its
// head is read: a handover that begins meanwhile ends the read, and the
// connection goes to the next image as it is (headRead). stop ends the
// watch.
func (h *handover) headStarted(t *tunnel, conn net.Conn) (stop func() bool) {
	return context.AfterFunc(h.s.leaving, func() { h.interruptUnasked(t, conn) })
}

// headRead is told that t's head was read (or failed), seen being the
// bytes read: true when t goes on to its dial (counted in pd), false when
// a handover took it first and passed it on.
func (h *handover) headRead(t *tunnel, pd *pendingDial, conn net.Conn, seen []byte) bool {
	if h.asked(t, pd) {
		return true
	}
	h.passUnasked(t, conn, seen)
	return false
}

// interruptUnasked ends the head read of t once a handover took it.
func (h *handover) interruptUnasked(t *tunnel, conn net.Conn) {
	s := h.s
	s.mu.Lock()
	taken := t.state == tunnelPassing
	s.mu.Unlock()
	if taken {
		conn.SetReadDeadline(time.Unix(1, 0))
	}
}

// asked moves t, whose head has been read (or failed), to dialing and
// counts its dial as pending; false when a handover took it first.
func (h *handover) asked(t *tunnel, pd *pendingDial) bool {
	s := h.s
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
// a plain socket moves to held, for the handover to collect (its goroutine
// does not close it: leave); a TLS one is closed (its handshake cannot
// move), which loses nothing its client asked for.
func (h *handover) passUnasked(t *tunnel, conn net.Conn, seen []byte) {
	s := h.s
	s.mu.Lock()
	defer s.mu.Unlock()
	defer h.moved.Broadcast()
	if wire.RawSocket(conn) == nil || s.closed {
		t.moveLocked(tunnelClosed)
		s.log.Debug("front-door connection that asked for nothing closed by the restart")
		return
	}
	t.handed = &PausedTunnel{Socket: conn, Unasked: true, Head: seen}
	t.moveLocked(tunnelHeld)
}

// dialWaiting passes t on to the next image as a connection that asked
// for nothing yet, when a handover began while its dial waited for an
// agent: no agent was asked, and none can log in to a server that is
// leaving, so the next image, whose agents log in again, dials it. What
// its client sent goes with it: the head (head) and whatever came after
// it (br's buffer, once the upload's first read is stopped). False when
// the shutdown is not a handover, or the handover is past taking it.
func (h *handover) dialWaiting(t *tunnel, conn net.Conn, head []byte, br *bufio.Reader) bool {
	s := h.s
	s.mu.Lock()
	ok := h.active && !h.collected && !s.closed && t.moveLocked(tunnelPassing)
	s.mu.Unlock()
	if !ok {
		return false
	}
	t.up.unblock()
	<-t.up.peeked
	rest, _ := br.Peek(br.Buffered())
	s.log.Debug("dial waiting for an agent handed to the next image", "addr", t.addr)
	h.passUnasked(t, conn, append(slices.Clip(head), rest...))
	return true
}

// handedIn resumes t when it is a tunnel a previous image paused
// (resumed): it opens the stream that carries its bytes through its
// agent; on failure it logs and returns false, and the client's
// connection is closed. Any other tunnel is not resumed.
func (h *handover) handedIn(t *tunnel, conn net.Conn) (ok, resumed bool) {
	if t.handed == nil || t.handed.Unasked {
		return false, false
	}
	s := h.s
	br := headReaders.Get().(*bufio.Reader)
	br.Reset(conn)
	s.initFrontendUpload(t, conn, br)
	t.addr = t.handed.Addr
	t.act.InheritQuiet(t.handed.Quiet)
	return h.resumeStream(t) == nil && t.move(tunnelOpen), true
}

// headSoFar is what a connection the previous image took before its head
// ended had sent, to be read again first; nil for any other connection.
func (h *handover) headSoFar(t *tunnel) []byte {
	if t.handed == nil {
		return nil
	}
	head := t.handed.Head
	t.handed = nil
	return head
}
