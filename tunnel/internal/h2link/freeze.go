package h2link

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// A serving end made with Config.Freezable can be frozen and rebuilt in
// another process on the same socket (a self-restart that keeps the
// peer's connection): its read loop stops at a frame boundary
// (StopReading), its handlers let their streams go without ending them
// (Detach), and Freeze returns what the next process needs: the windows,
// the peer's settings, the open streams and the header blocks the peer
// sent, which rebuild the HPACK decoder's dynamic table. ResumeServer
// rebuilds the connection; this end's HPACK encoder starts afresh and
// empties the peer's decoder table with its first header block (RFC 7541
// §4.2), so the two agree again. Frames the peer sends meanwhile wait in
// the kernel.

// ErrReadStopped is what a Body's Read returns once the connection's read
// loop stopped for a freeze and everything received was read.
var ErrReadStopped = errors.New("reading stopped for a handover")

// ErrNotAtRest is Freeze's answer while a handler still runs or a stream
// still holds received bytes: WaitAtRest waits until they are done.
var ErrNotAtRest = errors.New("freeze: a stream is not at rest")

// Freezable reports whether the connection was made with Config.Freezable.
func (l *Conn) Freezable() bool { return l.fread != nil }

// maxFrozenHeaders bounds the header blocks saved for a freeze; a
// connection whose peer sent more cannot be frozen.
const maxFrozenHeaders = 64 << 10

// Frozen is a serving end's state, enough to rebuild it (ResumeServer).
type Frozen struct {
	PeerMaxStreams uint32         `json:"peer_max_streams"`
	PeerWindow     int32          `json:"peer_window"`
	PeerMaxFrame   uint32         `json:"peer_max_frame"`
	SendWindow     int64          `json:"send_window"`
	RecvWindow     int64          `json:"recv_window"`
	RecvUnacked    int64          `json:"recv_unacked"`
	RecvTarget     int32          `json:"recv_target"`
	StreamWindow   int32          `json:"stream_window"`
	LastPeerID     uint32         `json:"last_peer_id"`
	HeaderFrames   []FrozenFrame  `json:"header_frames"`
	Streams        []FrozenStream `json:"streams"`
}

// FrozenFrame is one HEADERS or CONTINUATION frame the peer sent.
type FrozenFrame struct {
	Type    uint8  `json:"type"`
	Flags   uint8  `json:"flags"`
	Payload []byte `json:"payload"`
}

// FrozenStream is an open stream whose response head went out and whose
// received bytes were all read.
type FrozenStream struct {
	ID         uint32 `json:"id"`
	SendWindow int64  `json:"send_window"`
	RecvWindow int64  `json:"recv_window"`
	Unacked    int64  `json:"unacked"`
	RecvSize   int32  `json:"recv_size"`
}

// frameReader is the read side of a freezable connection: it passes the
// bytes through to the framer, knows where each frame ends, keeps the
// header blocks, and once stopping is set returns errStopRead at the next
// frame boundary. Owned by the read loop; stopping is set by StopReading.
type frameReader struct {
	conn     net.Conn
	hdr      [9]byte
	hdrN     int    // header bytes of the current frame read so far
	left     int    // payload bytes of the current frame still to read
	capture  []byte // the current frame's payload, when it is a header block
	frames   []FrozenFrame
	size     int  // payload bytes in frames
	overflow bool // the peer sent more header blocks than maxFrozenHeaders
	stopping atomic.Bool
}

var errStopRead = errors.New("read loop stopped for a freeze")

func (r *frameReader) Read(p []byte) (int, error) {
	for {
		atBoundary := r.hdrN == 0 && r.left == 0
		if atBoundary && r.stopping.Load() {
			return 0, errStopRead
		}
		if r.hdrN < len(r.hdr) {
			p = p[:min(len(p), len(r.hdr)-r.hdrN)]
		} else {
			p = p[:min(len(p), r.left)]
		}
		n, err := r.conn.Read(p)
		r.consume(p[:n])
		if err != nil && r.stopping.Load() && errors.Is(err, os.ErrDeadlineExceeded) {
			if r.hdrN == 0 && r.left == 0 {
				if n > 0 {
					return n, nil // errStopRead on the next call
				}
				return 0, errStopRead
			}
			// In the middle of a frame: the rest is on its way.
			r.conn.SetReadDeadline(time.Time{})
			if n > 0 {
				return n, nil
			}
			continue
		}
		return n, err
	}
}

// consume follows the frame boundaries through b.
func (r *frameReader) consume(b []byte) {
	for len(b) > 0 {
		if r.hdrN < len(r.hdr) {
			c := copy(r.hdr[r.hdrN:], b)
			r.hdrN += c
			b = b[c:]
			if r.hdrN == len(r.hdr) {
				r.left = int(r.hdr[0])<<16 | int(r.hdr[1])<<8 | int(r.hdr[2])
				typ := http2.FrameType(r.hdr[3])
				r.capture = nil
				if (typ == http2.FrameHeaders || typ == http2.FrameContinuation) && !r.overflow {
					r.capture = make([]byte, 0, r.left)
				}
				r.endFrameIfEmpty()
			}
			continue
		}
		c := min(len(b), r.left)
		if r.capture != nil {
			r.capture = append(r.capture, b[:c]...)
		}
		r.left -= c
		b = b[c:]
		r.endFrameIfEmpty()
	}
}

func (r *frameReader) endFrameIfEmpty() {
	if r.left > 0 {
		return
	}
	if r.capture != nil {
		r.size += len(r.capture)
		if r.size > maxFrozenHeaders {
			r.overflow, r.frames = true, nil
		} else {
			r.frames = append(r.frames, FrozenFrame{Type: r.hdr[3], Flags: r.hdr[4], Payload: r.capture})
		}
		r.capture = nil
	}
	r.hdrN = 0
}

// StopReading stops the read loop of a freezable serving end at the next
// frame boundary, and wakes readers of request bodies, which get
// ErrReadStopped once they have read what was received. The connection
// stays open: Freeze hands it on, Close ends it.
func (l *Conn) StopReading(ctx context.Context) error {
	if l.fread == nil {
		return errors.New("connection is not freezable")
	}
	l.fread.stopping.Store(true)
	l.conn.SetReadDeadline(time.Now())
	select {
	case <-l.readParked:
	case <-l.readerDone:
		return l.err()
	case <-ctx.Done():
		return ctx.Err()
	}
	l.mu.Lock()
	streams := make([]*stream, 0, len(l.streams))
	for _, st := range l.streams {
		streams = append(streams, st)
	}
	l.mu.Unlock()
	for _, st := range streams {
		st.rmu.Lock()
		next := st.wakeRLocked()
		st.rmu.Unlock()
		next()
	}
	return nil
}

// readStopped reports whether the read loop stopped for a freeze.
func (l *Conn) readStopped() bool {
	select {
	case <-l.readParked:
		return true
	default:
		return false
	}
}

// Detach, called by a handler before it returns, lets its stream stay open
// and unanswered-for: no END_STREAM, no reset. The stream is then Freeze's.
func Detach(w http.ResponseWriter) {
	if rw, ok := w.(*responseWriter); ok {
		rw.detached = true
	}
}

// Freeze ends this end's part in a connection whose read loop stopped
// (StopReading) and whose handlers returned detached: the queued control
// frames are sent, nothing is written afterwards, and the state returned
// rebuilds the connection elsewhere (ResumeServer). The socket stays
// open; the caller hands it on and closes its own descriptor.
func (l *Conn) Freeze() (*Frozen, error) {
	if !l.readStopped() {
		return nil, errors.New("freeze: the read loop has not stopped")
	}
	if l.fread.overflow {
		return nil, errors.New("freeze: the peer sent too many header blocks")
	}
	if err := l.atRest(); err != nil {
		return nil, err
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	// The last control frames go out, and no more are queued. On an
	// error the connection is the caller's to Close.
	l.ctlMu.Lock()
	q := l.ctlQueue
	l.ctlQueue, l.ctlClosed = nil, true
	l.ctlMu.Unlock()
	for _, f := range q {
		if err := f(l.fr); err != nil {
			return nil, fmt.Errorf("freeze: %w", err)
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, l.closeErr
	}
	f := &Frozen{
		PeerMaxStreams: l.peerMaxStreams, PeerWindow: l.peerWindow, PeerMaxFrame: l.peerMaxFrame,
		SendWindow: l.sendWindow.avail(), RecvWindow: l.recvWindow.avail(), RecvUnacked: l.recvUnacked,
		RecvTarget: l.recvTarget, StreamWindow: l.streamWindow, LastPeerID: l.lastPeerID,
		HeaderFrames: l.fread.frames,
	}
	for _, st := range l.streams {
		st.rmu.Lock()
		f.Streams = append(f.Streams, FrozenStream{ID: st.id, SendWindow: st.sendWindow.avail(), RecvWindow: st.recvWindow.avail(), Unacked: st.unacked, RecvSize: st.recvSize})
		st.rmu.Unlock()
	}
	// From here this end is done with the connection, but does not close it.
	l.closed = true
	l.capacityChangedLocked()
	l.closeErr = ErrClosed
	if l.pingTimer != nil {
		l.pingTimer.Stop()
	}
	l.wakeEverySenderLocked()
	close(l.frozen)
	return f, nil
}

// atRest checks that every stream can be frozen: open, answered, its
// handler returned detached, nothing received left unread. Once the read
// loop stopped and the handlers returned, nothing changes that but Close.
func (l *Conn) atRest() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, st := range l.streams {
		st.rmu.Lock()
		busy := len(st.queue) > 0 || st.eof || st.recvErr != nil || st.sink != nil
		st.rmu.Unlock()
		if st.handlerRunning || !st.answered || st.state != stateOpen || busy {
			return fmt.Errorf("%w: stream %d (%s)", ErrNotAtRest, st.id, st.state)
		}
	}
	return nil
}

// WaitAtRest waits until Freeze would find every stream at rest, looking
// again each time a handler returns or a stream leaves; it returns early
// when ctx ends or the connection closes.
func (l *Conn) WaitAtRest(ctx context.Context) error {
	if l.fread == nil {
		return errors.New("connection is not freezable")
	}
	for {
		l.mu.Lock()
		if l.rest == nil {
			l.rest = make(chan struct{})
		}
		changed := l.rest
		l.mu.Unlock()
		err := l.atRest()
		if err == nil {
			return nil
		}
		select {
		case <-changed:
		case <-l.frozen:
			return l.err()
		case <-ctx.Done():
			return fmt.Errorf("%w: %w", err, ctx.Err())
		}
	}
}

// restChangedLocked wakes WaitAtRest, if it waits: a handler returned or a
// stream left. The caller holds l.mu.
func (l *Conn) restChangedLocked() {
	if l.rest != nil {
		close(l.rest)
		l.rest = nil
	}
}

// ResumeServer rebuilds on conn a serving end a previous process froze.
// handler serves the streams the peer opens from now on; resumed serves
// each frozen stream, as a handler whose response head went out (it
// writes DATA and sets trailers as any handler does). Both start with
// Serve.
func ResumeServer(conn net.Conn, cfg Config, f *Frozen, handler http.Handler, resumed func(http.ResponseWriter, *http.Request)) (*Conn, error) {
	l := newConn(conn, cfg, true)
	l.handler = handler
	l.resetBudget = l.cfg.MaxPeerResets
	l.budgetAt = time.Now()
	dec := hpack.NewDecoder(4096, func(hpack.HeaderField) {})
	l.fread.frames, l.fread.size = f.HeaderFrames, 0
	for _, hf := range f.HeaderFrames {
		l.fread.size += len(hf.Payload)
		frag, err := headerFragment(hf)
		if err == nil {
			_, err = dec.Write(frag)
		}
		if err == nil && hf.Flags&uint8(http2.FlagHeadersEndHeaders) != 0 {
			err = dec.Close()
		}
		if err != nil {
			return nil, fmt.Errorf("rebuild the HPACK decoder: %w", err)
		}
	}
	l.fr.ReadMetaHeaders = dec
	// The peer's decoder table holds what the previous encoder put there:
	// the first header block from here on empties it.
	l.henc.SetMaxDynamicTableSize(0)
	l.henc.SetMaxDynamicTableSize(4096)

	l.peerMaxStreams, l.peerWindow, l.peerMaxFrame = f.PeerMaxStreams, f.PeerWindow, f.PeerMaxFrame
	l.capacityChangedLocked()
	l.sendWindow, l.recvWindow = window{f.SendWindow}, window{f.RecvWindow}
	l.recvUnacked, l.recvTarget, l.streamWindow = f.RecvUnacked, f.RecvTarget, f.StreamWindow
	l.lastPeerID = f.LastPeerID
	for _, fs := range f.Streams {
		st := newStream(l, fs.ID, stateOpen)
		st.sendWindow, st.recvWindow = window{fs.SendWindow}, window{fs.RecvWindow}
		st.unacked, st.recvSize = fs.Unacked, fs.RecvSize
		st.answered, st.handlerRunning, st.counted = true, true, true
		ctx, cancel := context.WithCancel(l.cfg.BaseContext)
		st.cancelCtx = cancel
		req := (&http.Request{
			Method: http.MethodPost, URL: &url.URL{Path: "/"}, Proto: "HTTP/2.0", ProtoMajor: 2,
			Header: make(http.Header), Body: &Body{st: st}, RemoteAddr: conn.RemoteAddr().String(),
		}).WithContext(ctx)
		l.counted++
		l.streams[st.id] = st
		l.capacityChangedLocked()
		w := &responseWriter{st: st, header: make(http.Header), status: http.StatusOK, headersSent: true}
		l.resumed = append(l.resumed, func() { l.runResumed(st, w, req, resumed) })
	}
	return l, nil
}

// headerFragment is a HEADERS or CONTINUATION frame's header block
// fragment: its payload without padding and priority (RFC 9113 §6.2).
func headerFragment(f FrozenFrame) ([]byte, error) {
	p := f.Payload
	if http2.FrameType(f.Type) != http2.FrameHeaders {
		return p, nil
	}
	pad := 0
	if f.Flags&uint8(http2.FlagHeadersPadded) != 0 {
		if len(p) < 1 {
			return nil, io.ErrUnexpectedEOF
		}
		pad, p = int(p[0]), p[1:]
	}
	if f.Flags&uint8(http2.FlagHeadersPriority) != 0 {
		if len(p) < 5 {
			return nil, io.ErrUnexpectedEOF
		}
		p = p[5:]
	}
	if pad > len(p) {
		return nil, io.ErrUnexpectedEOF
	}
	return p[:len(p)-pad], nil
}

// runResumed serves a frozen stream as runHandler serves a new one.
func (l *Conn) runResumed(st *stream, w *responseWriter, req *http.Request, serve func(http.ResponseWriter, *http.Request)) {
	completed := false
	defer func() {
		switch {
		case !completed:
			recover()
			st.reset(http2.ErrCodeInternal, ErrStreamReset)
			st.handlerDone()
		case !w.outlives:
			w.end()
		}
	}()
	serve(w, req)
	completed = true
}
