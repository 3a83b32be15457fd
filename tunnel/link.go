package tunnel

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// link is one agent connection's HTTP/2, written for this one job instead
// of x/net's general Transport and Server. On the server it is the client
// end (newLink): RoundTrip opens a tunnel. On the agent it is the server end
// (newAgentLink): each stream the server opens runs an http.Handler.
//
// Why not x/net: its Transport parks a goroutine per stream holding a
// 64 KiB scratch buffer for the request body (pooled, hence resident, for
// every open tunnel) and hands every request to another goroutine; its
// Server passes every frame and every handler write through its serve loop
// goroutine and writes large frames from yet another. Here whoever has
// bytes writes the frame itself, under one lock, in one system call, and
// the read loop hands a DATA payload straight to the stream's reader.
//
// The rules that keep it simple: the read loop never blocks on a write
// (control frames it must send go through a queue that whoever holds the
// write lock flushes), every frame write is one call on the connection, and
// a stream is removed once both halves have ended or either side reset it.
type link struct {
	conn     net.Conn
	batch    *recordBatcher // under TLS: gathers a write's records into one system call
	fr       *http2.Framer  // reads: the read loop only; writes: under wmu
	spawn    func(func())   // runs an owned goroutine
	writeTTL time.Duration  // a write that makes no progress this long breaks the link

	wmu  sync.Mutex
	henc *hpack.Encoder
	hbuf bytes.Buffer

	ctlMu       sync.Mutex
	ctlQueue    []func(*http2.Framer) error
	ctlFlushing bool // a flusher goroutine runs
	ctlClosed   bool // the link is closed: nothing more is queued
	flushers    sync.WaitGroup

	mu             sync.Mutex
	windowCond     *sync.Cond // send windows grew, or the link or a stream ended
	streams        map[uint32]*linkStream
	nextID         uint32
	closed         bool
	closeErr       error
	goAway         bool          // no new streams: we or the agent said GOAWAY
	retiring       bool          // stream IDs ran out: see retire
	idle           chan struct{} // closed when goAway is set and no stream is left
	peerMaxStreams uint32
	peerWindow     int32 // SETTINGS_INITIAL_WINDOW_SIZE of the agent
	peerMaxFrame   uint32
	connSendWindow int64
	connRecvUnack  int64

	// The agent's end only: streams are opened by the server and served
	// by handler, each on its own goroutine.
	handler    http.Handler
	baseCtx    context.Context
	maxStreams uint32 // streams the server may have open at once
	lastPeerID uint32
	window     int64 // the receive window this end gives each stream

	lastRead   atomic.Int64 // unix nanoseconds of the last frame read
	keepAlive  time.Duration
	pingWait   time.Duration
	pingTimer  *time.Timer
	pingData   [8]byte
	pingOut    bool // a PING is outstanding
	readerDone chan struct{}
}

// Errors of the link. A dial that meets errLinkClosed or errGoAway before
// the agent answered is retried on another agent: nothing was sent.
var (
	errLinkClosed  = errors.New("agent connection closed")
	errGoAway      = errors.New("agent connection is going away")
	errStreamReset = errors.New("tunnel reset")
	errPingTimeout = errors.New("no answer to PING")

	// What remove tells a caller still waiting for the answer; made once,
	// as every stream's end passes it (a no-op for the answered ones).
	errEndedUnanswered = fmt.Errorf("%w: the stream ended before the agent answered", errStreamReset)
)

// Receive windows this end announces; see streamWindow for why 1 MiB.
const (
	linkConnWindow    = 1 << 30
	linkRefillAt      = 16 << 20 // connection credit is returned in steps of this much: 1/64 of the window, so seldom
	initialPeerWindow = 65535    // HTTP/2 defaults until the agent's SETTINGS
	initialPeerFrame  = 16 << 10
)

// newLink starts HTTP/2 on conn (the agent is the server) and its read loop
// through spawn. keepAlive and pingWait set the PING that finds dead peers.
func newLink(conn net.Conn, keepAlive, pingWait time.Duration, spawn func(func())) (*link, error) {
	l := newLinkState(conn, keepAlive, pingWait, streamWindow, spawn)
	l.nextID = 1

	l.armWrite()
	if _, err := io.WriteString(conn, http2.ClientPreface); err != nil {
		return nil, fmt.Errorf("write HTTP/2 preface: %w", err)
	}
	err := l.fr.WriteSettings(
		http2.Setting{ID: http2.SettingEnablePush, Val: 0},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: streamWindow},
		http2.Setting{ID: http2.SettingMaxFrameSize, Val: maxFrameSize},
	)
	if err == nil {
		err = l.fr.WriteWindowUpdate(0, linkConnWindow-initialPeerWindow)
	}
	if err != nil {
		return nil, fmt.Errorf("write HTTP/2 settings: %w", err)
	}
	if keepAlive > 0 {
		l.pingTimer = time.AfterFunc(keepAlive, l.keepAliveTick)
	}
	spawn(l.readLoop)
	return l, nil
}

// newLinkState is what both ends share before their first frame.
func newLinkState(conn net.Conn, keepAlive, pingWait time.Duration, window int64, spawn func(func())) *link {
	l := &link{
		conn:           conn,
		spawn:          spawn,
		writeTTL:       keepAlive + pingWait,
		streams:        make(map[uint32]*linkStream),
		peerMaxStreams: math.MaxUint32,
		peerWindow:     initialPeerWindow,
		peerMaxFrame:   initialPeerFrame,
		connSendWindow: initialPeerWindow,
		keepAlive:      keepAlive,
		pingWait:       pingWait,
		readerDone:     make(chan struct{}),
		window:         window,
	}
	l.windowCond = sync.NewCond(&l.mu)
	l.batch = batcherOf(conn)
	l.fr = http2.NewFramer(conn, conn)
	l.fr.SetMaxReadFrameSize(maxFrameSize)
	l.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	l.fr.MaxHeaderListSize = 64 << 10
	l.henc = hpack.NewEncoder(&l.hbuf)
	l.lastRead.Store(time.Now().UnixNano())
	return l
}

// --- writing ---

// lockWrite takes the write lock and arms the write deadline.
func (l *link) lockWrite() {
	l.wmu.Lock()
	l.armWrite()
}

// armWrite bounds the next write: a peer that stops reading breaks the
// link instead of holding a writer forever.
func (l *link) armWrite() {
	if l.writeTTL > 0 {
		l.conn.SetWriteDeadline(time.Now().Add(l.writeTTL))
	}
}

// unlockWrite sends the control frames queued meanwhile, then releases the
// write lock.
func (l *link) unlockWrite() {
	err := l.flushControlLocked()
	l.wmu.Unlock()
	if err != nil {
		l.closeWith(fmt.Errorf("write: %w", err))
	}
}

func (l *link) flushControlLocked() error {
	l.ctlMu.Lock()
	q := l.ctlQueue
	l.ctlQueue = nil
	l.ctlMu.Unlock()
	for _, f := range q {
		if err := f(l.fr); err != nil {
			return err
		}
	}
	return nil
}

// writeControl queues a control frame (SETTINGS ACK, PING, WINDOW_UPDATE,
// RST_STREAM, GOAWAY) and returns at once. It never writes itself: its
// callers are the read loop, which must not wait for a write that waits
// for the peer to read, and readers holding a stream's lock. A flusher
// goroutine, one at a time, sends the queue unless a data writer holding
// the write lock sends it first.
func (l *link) writeControl(f func(*http2.Framer) error) {
	l.ctlMu.Lock()
	if l.ctlClosed {
		l.ctlMu.Unlock()
		return
	}
	l.ctlQueue = append(l.ctlQueue, f)
	start := !l.ctlFlushing
	l.ctlFlushing = true
	if start {
		l.flushers.Add(1)
	}
	l.ctlMu.Unlock()
	if start {
		go l.flushControl()
	}
}

// flushControl sends queued control frames until the queue is empty. The
// read loop waits for it before it ends, so it has an owner.
func (l *link) flushControl() {
	defer l.flushers.Done()
	for {
		l.lockWrite()
		err := l.batched(l.flushControlLocked) // all queued frames in one system call
		l.wmu.Unlock()
		if err != nil {
			l.closeWith(fmt.Errorf("write: %w", err))
		}
		l.ctlMu.Lock()
		if len(l.ctlQueue) == 0 || l.ctlClosed {
			l.ctlFlushing = false
			l.ctlQueue = nil
			l.ctlMu.Unlock()
			return
		}
		l.ctlMu.Unlock()
	}
}

// --- the client API the server uses ---

// RoundTrip opens one stream: a CONNECT tunnel (req.Body is the upload) or
// the GET of the control stream. It returns once the agent answered. The
// request's context ends the stream at any time.
func (l *link) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	noBody := req.Body == nil
	st := &linkStream{link: l, body: req.Body, respReady: make(chan struct{}), sentEnd: noBody}
	st.recvCond = sync.NewCond(&st.rmu)

	l.wmu.Lock()
	l.mu.Lock()
	switch {
	case l.closed:
		l.mu.Unlock()
		l.wmu.Unlock()
		return nil, l.closeErr
	case l.goAway:
		l.mu.Unlock()
		l.wmu.Unlock()
		return nil, errGoAway
	}
	if l.nextID > maxStreamID {
		// A billion dials on one connection: its stream IDs are spent.
		l.mu.Unlock()
		l.wmu.Unlock()
		l.retire()
		return nil, errGoAway
	}
	st.id = l.nextID
	l.nextID += 2
	st.sendWindow = int64(l.peerWindow)
	st.recvWindow = l.window
	l.streams[st.id] = st
	l.mu.Unlock()

	l.hbuf.Reset()
	l.henc.WriteField(hpack.HeaderField{Name: ":method", Value: req.Method})
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	l.henc.WriteField(hpack.HeaderField{Name: ":authority", Value: host})
	if req.Method != http.MethodConnect {
		path := req.URL.RequestURI()
		l.henc.WriteField(hpack.HeaderField{Name: ":scheme", Value: "https"})
		l.henc.WriteField(hpack.HeaderField{Name: ":path", Value: path})
	}
	l.armWrite()
	err := l.fr.WriteHeaders(http2.HeadersFrameParam{
		StreamID: st.id, BlockFragment: l.hbuf.Bytes(), EndStream: noBody, EndHeaders: true,
	})
	if err != nil {
		l.wmu.Unlock()
		l.closeWith(fmt.Errorf("write: %w", err))
		return nil, l.err()
	}
	l.unlockWrite()

	if !noBody && !sentByCaller(req.Body) {
		l.spawn(st.pumpUpload)
	}
	select {
	case <-st.respReady:
	case <-ctx.Done():
		st.reset(http2.ErrCodeCancel, ctx.Err())
		return nil, ctx.Err()
	}
	if st.resp == nil {
		return nil, st.respErr
	}
	// Ending the request's context ends the tunnel, as with net/http.
	stop := context.AfterFunc(ctx, func() { st.reset(http2.ErrCodeCancel, context.Canceled) })
	st.mu().Lock()
	st.stopCtx = stop
	gone := st.removed
	st.mu().Unlock()
	if gone {
		stop()
	}
	return st.resp, nil
}

// HTTP/2 stream IDs are 31 bits; the client's are odd.
const maxStreamID = 1<<31 - 1

// retireGrace bounds how long a connection whose stream IDs ran out keeps
// its open tunnels before it is closed and the agent dials a fresh one.
const retireGrace = time.Minute

// retire ends a connection that can open no more streams: GOAWAY now (new
// dials go to other agents), close once its tunnels ended or after
// retireGrace; the agent then redials at once.
func (l *link) retire() {
	l.mu.Lock()
	first := !l.retiring
	l.retiring = true
	l.mu.Unlock()
	if !first {
		return
	}
	l.spawn(func() {
		ctx, cancel := context.WithTimeout(context.Background(), retireGrace)
		defer cancel()
		if l.Shutdown(ctx) != nil {
			l.Close()
		}
	})
}

// CanTakeNewRequest reports whether a new stream may be opened now.
func (l *link) CanTakeNewRequest() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return !l.closed && !l.goAway && l.nextID <= maxStreamID && uint32(len(l.streams)) < l.peerMaxStreams
}

// Shutdown sends GOAWAY, lets the open streams finish, then closes. It
// returns ctx's error if they had not finished in time (the caller closes).
func (l *link) Shutdown(ctx context.Context) error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.goAway = true
	if l.idle == nil {
		l.idle = make(chan struct{})
		if len(l.streams) == 0 {
			close(l.idle)
		}
	}
	idle := l.idle
	l.mu.Unlock()
	l.writeControl(func(fr *http2.Framer) error { return fr.WriteGoAway(0, http2.ErrCodeNo, nil) })
	select {
	case <-idle:
		l.Close()
		return nil
	case <-l.readerDone:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close ends the connection and every stream on it.
func (l *link) Close() error {
	l.closeWith(errLinkClosed)
	return nil
}

func (l *link) err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closeErr != nil {
		return l.closeErr
	}
	return errLinkClosed
}

func (l *link) closeWith(err error) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.closed = true
	l.closeErr = fmt.Errorf("%w: %v", errLinkClosed, err)
	if errors.Is(err, errLinkClosed) {
		l.closeErr = errLinkClosed
	}
	streams := make([]*linkStream, 0, len(l.streams))
	for _, st := range l.streams {
		streams = append(streams, st)
	}
	if l.pingTimer != nil {
		l.pingTimer.Stop()
	}
	l.windowCond.Broadcast()
	l.mu.Unlock()
	l.ctlMu.Lock()
	l.ctlClosed = true
	l.ctlMu.Unlock()
	l.conn.Close()
	for _, st := range streams {
		st.fail(l.closeErr)
	}
}

// --- keepalive ---

// keepAliveTick runs once nothing was read for keepAlive: it sends a PING,
// and closes the connection if the answer does not come within pingWait.
// It runs on the timer's goroutine, which lives only for the call.
func (l *link) keepAliveTick() {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	if l.pingOut {
		l.mu.Unlock()
		l.closeWith(errPingTimeout)
		return
	}
	if idleFor := time.Since(time.Unix(0, l.lastRead.Load())); idleFor < l.keepAlive {
		l.pingTimer.Reset(l.keepAlive - idleFor)
		l.mu.Unlock()
		return
	}
	l.pingOut = true
	rand.Read(l.pingData[:])
	data := l.pingData
	l.pingTimer.Reset(l.pingWait)
	l.mu.Unlock()
	l.writeControl(func(fr *http2.Framer) error { return fr.WritePing(false, data) })
}

// --- reading ---

func (l *link) readLoop() {
	defer close(l.readerDone)
	defer l.flushers.Wait() // after closeWith: no flusher starts any more
	for {
		f, err := l.fr.ReadFrame()
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				l.resetFromPeerError(se)
				continue
			}
			l.closeWith(err)
			return
		}
		l.lastRead.Store(time.Now().UnixNano())
		if err := l.handle(f); err != nil {
			l.writeControl(func(fr *http2.Framer) error { return fr.WriteGoAway(0, http2.ErrCodeProtocol, nil) })
			l.closeWith(err)
			return
		}
	}
}

// resetFromPeerError answers a malformed frame that concerns one stream.
func (l *link) resetFromPeerError(se http2.StreamError) {
	l.mu.Lock()
	st := l.streams[se.StreamID]
	l.mu.Unlock()
	if st != nil {
		st.reset(se.Code, fmt.Errorf("%w: %v", errStreamReset, se))
	}
}

func (l *link) handle(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.DataFrame:
		return l.onData(f)
	case *http2.MetaHeadersFrame:
		return l.onHeaders(f)
	case *http2.RSTStreamFrame:
		l.mu.Lock()
		st := l.streams[f.StreamID]
		l.mu.Unlock()
		if st != nil {
			st.resetByPeer(f.ErrCode)
		}
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		if err := l.applySettings(f); err != nil {
			return err
		}
		l.writeControl(func(fr *http2.Framer) error { return fr.WriteSettingsAck() })
	case *http2.PingFrame:
		if !f.IsAck() {
			data := f.Data
			l.writeControl(func(fr *http2.Framer) error { return fr.WritePing(true, data) })
			return nil
		}
		l.mu.Lock()
		if l.pingOut && f.Data == l.pingData {
			l.pingOut = false
			if l.pingTimer != nil {
				l.pingTimer.Reset(l.keepAlive)
			}
		}
		l.mu.Unlock()
	case *http2.GoAwayFrame:
		l.onGoAway(f)
	case *http2.WindowUpdateFrame:
		return l.onWindowUpdate(f)
	case *http2.PushPromiseFrame:
		return errors.New("PUSH_PROMISE though push is disabled")
	}
	return nil // unknown and priority frames are ignored
}

func (l *link) applySettings(f *http2.SettingsFrame) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return f.ForeachSetting(func(s http2.Setting) error {
		if err := s.Valid(); err != nil {
			return err
		}
		switch s.ID {
		case http2.SettingMaxFrameSize:
			l.peerMaxFrame = s.Val
		case http2.SettingMaxConcurrentStreams:
			l.peerMaxStreams = s.Val
		case http2.SettingInitialWindowSize:
			delta := int64(s.Val) - int64(l.peerWindow)
			l.peerWindow = int32(s.Val)
			for _, st := range l.streams {
				st.sendWindow += delta
			}
			l.windowCond.Broadcast()
		}
		return nil
	})
}

func (l *link) onGoAway(f *http2.GoAwayFrame) {
	l.mu.Lock()
	l.goAway = true
	// The last stream ID counts streams this end opened; on the agent's end
	// the server opened them all, and they go on.
	var refused []*linkStream
	for id, st := range l.streams {
		if l.handler == nil && id > f.LastStreamID {
			refused = append(refused, st)
		}
	}
	if l.idle == nil {
		l.idle = make(chan struct{})
		if len(l.streams) == len(refused) {
			close(l.idle)
		}
	}
	l.mu.Unlock()
	for _, st := range refused {
		st.fail(errGoAway) // never seen by the agent: safe to retry elsewhere
	}
}

func (l *link) onWindowUpdate(f *http2.WindowUpdateFrame) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if f.StreamID == 0 {
		l.connSendWindow += int64(f.Increment)
		if l.connSendWindow > math.MaxInt32 {
			return errors.New("connection flow-control window overflow")
		}
	} else if st := l.streams[f.StreamID]; st != nil {
		st.sendWindow += int64(f.Increment)
	}
	l.windowCond.Broadcast()
	return nil
}

func (l *link) onHeaders(f *http2.MetaHeadersFrame) error {
	if f.Truncated {
		// Past MaxHeaderListSize (far past it closes the connection in the
		// framer): refuse this stream, keep the connection.
		l.mu.Lock()
		st := l.streams[f.StreamID]
		if l.handler != nil && st == nil && f.StreamID > l.lastPeerID && f.StreamID%2 == 1 {
			l.lastPeerID = f.StreamID
		}
		l.mu.Unlock()
		if st != nil {
			st.reset(http2.ErrCodeProtocol, fmt.Errorf("%w: header list too large", errStreamReset))
		} else {
			id := f.StreamID
			l.writeControl(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeRefusedStream) })
		}
		return nil
	}
	if l.handler != nil {
		return l.onRequest(f)
	}
	l.onResponse(f)
	return nil
}

func (l *link) onResponse(f *http2.MetaHeadersFrame) {
	l.mu.Lock()
	st := l.streams[f.StreamID]
	l.mu.Unlock()
	if st == nil {
		return // a stream we already ended
	}
	st.rmu.Lock()
	answered := st.resp != nil || st.respErr != nil
	st.rmu.Unlock()
	if answered {
		// Trailers, or an answer to a stream already failed: only
		// END_STREAM matters here.
		if f.StreamEnded() {
			st.endRecv()
		}
		return
	}
	code, err := strconv.Atoi(f.PseudoValue("status"))
	if err != nil || code < 200 {
		if err == nil && code >= 100 {
			return // an informational answer; the final one follows
		}
		st.reset(http2.ErrCodeProtocol, fmt.Errorf("%w: bad :status %q", errStreamReset, f.PseudoValue("status")))
		return
	}
	header := make(http.Header, len(f.RegularFields()))
	for _, hf := range f.RegularFields() {
		header.Add(hf.Name, hf.Value)
	}
	st.rmu.Lock()
	if st.respErr == nil { // else the stream failed meanwhile and respReady is closed
		st.resp = &http.Response{
			StatusCode: code, Status: strconv.Itoa(code) + " " + http.StatusText(code),
			Proto: "HTTP/2.0", ProtoMajor: 2, Header: header, Body: &linkBody{st: st},
		}
		close(st.respReady)
	}
	st.rmu.Unlock()
	if f.StreamEnded() {
		st.endRecv()
	}
}

func (l *link) onData(f *http2.DataFrame) error {
	n := int64(f.Header().Length) // flow control counts padding too
	l.mu.Lock()
	st := l.streams[f.StreamID]
	l.connRecvUnack += n
	refill := l.connRecvUnack
	if refill >= linkRefillAt {
		l.connRecvUnack = 0
	}
	l.mu.Unlock()
	if refill >= linkRefillAt {
		l.writeControl(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, uint32(refill)) })
	}
	if st == nil {
		return nil // a stream we ended: its bytes are dropped, its credit returned above
	}
	st.rmu.Lock()
	answered := st.resp != nil || l.handler != nil
	st.rmu.Unlock()
	if !answered {
		st.reset(http2.ErrCodeProtocol, fmt.Errorf("%w: DATA before the agent's answer", errStreamReset))
		return nil
	}
	if err := st.receive(f.Data(), n); err != nil {
		st.reset(http2.ErrCodeFlowControl, err)
		return nil
	}
	if f.StreamEnded() {
		st.endRecv()
	}
	return nil
}

// --- streams ---

// linkStream is one tunnel (or the control stream) on a link.
type linkStream struct {
	link *link
	id   uint32
	body io.ReadCloser // the upload; nil for a GET

	// Guarded by link.mu.
	sendWindow int64
	sentEnd    bool
	removed    bool
	stopCtx    func() bool
	bodyClosed bool

	cancelCtx context.CancelFunc // the agent's end: ends the handler's request context

	respReady chan struct{} // closed once resp or respErr is set
	resp      *http.Response
	respErr   error

	// The receive side, guarded by rmu.
	rmu        sync.Mutex
	recvCond   *sync.Cond
	queue      []*[]byte   // received payloads, oldest first
	head       int         // bytes of queue[0] already read
	recvEnd    bool        // END_STREAM seen
	recvErr    error       // the stream was reset or the link failed
	recvWindow int64       // what the agent may still send
	unacked    int64       // consumed but not yet returned to the agent
	readerGone bool        // the response body was closed
	sink       *socketSink // set by deliverTo: bytes go straight to a socket
}

func (st *linkStream) mu() *sync.Mutex { return &st.link.mu }

// sentByCaller reports a request body that the caller sends itself once
// it has the answer (linkBody.sendUpload), on the goroutine it has anyway,
// rather than on one more per tunnel that waits through the dial.
func sentByCaller(body io.Reader) bool {
	b, ok := body.(interface{ sentByCaller() bool })
	return ok && b.sentByCaller()
}

// sendUpload sends the request body of a stream whose caller sends it (see
// sentByCaller), until the body ends or the stream does.
func (b *linkBody) sendUpload() { b.st.pumpUpload() }

// pumpUpload copies the request body into DATA frames, holding a small
// buffer while the client is quiet.
func (st *linkStream) pumpUpload() {
	defer st.closeBody()
	var err error
	if ub, ok := st.body.(*uploadBody); ok && ub.u.raw != nil {
		// A plain client socket: no buffer held while quiet. Two calls
		// rather than one that does both, to keep the frames of an idle
		// tunnel small (see (*Agent).carry).
		if err = ub.sendBuffered(streamWriter{st}); err == nil {
			err = ub.sendFromSocket(streamWriter{st})
		}
	} else {
		_, err = copyStream(streamWriter{st}, st.body, nil)
	}
	if err != nil {
		st.reset(http2.ErrCodeCancel, fmt.Errorf("%w: upload: %v", errStreamReset, err))
		return
	}
	st.writeData(nil, true)
}

// writeFrames writes p as DATA frames of at most frame bytes, the last with
// END_STREAM when end is set. Under TLS the frames' records are gathered
// and leave in one write.
func (l *link) writeFrames(id uint32, p []byte, frame int, end bool) error {
	l.lockWrite()
	err := l.batched(func() error {
		for first := true; first || len(p) > 0; first = false {
			n := min(len(p), frame)
			if err := l.fr.WriteData(id, end && n == len(p), p[:n]); err != nil {
				return err
			}
			p = p[n:]
		}
		return l.flushControlLocked() // queued WINDOW_UPDATEs ride along
	})
	l.wmu.Unlock()
	return err
}

// batched runs write, which holds the write lock, with the TLS records it
// makes gathered into one system call (see recordBatcher).
func (l *link) batched(write func() error) error {
	if l.batch == nil {
		return write()
	}
	l.batch.begin()
	err := write()
	if berr := l.batch.end(); err == nil {
		err = berr
	}
	return err
}

// batcherOf finds the record batcher under a link's connection, if any.
func batcherOf(c net.Conn) *recordBatcher {
	switch c := c.(type) {
	case *watchedConn:
		return batcherOf(c.Conn)
	case *bufferedConn:
		return batcherOf(c.Conn)
	case *batchedTLS:
		return c.raw
	case *recordBatcher:
		return c
	}
	return nil
}

// streamWriter writes DATA frames on a stream.
type streamWriter struct{ st *linkStream }

func (w streamWriter) Write(p []byte) (int, error) {
	if err := w.st.writeData(p, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

// writeData sends p as DATA frames within the flow-control windows, the
// last one with END_STREAM when end is set.
func (st *linkStream) writeData(p []byte, end bool) error {
	l := st.link
	for {
		l.mu.Lock()
		for !st.removed && !l.closed && len(p) > 0 && (st.sendWindow <= 0 || l.connSendWindow <= 0) {
			l.windowCond.Wait()
		}
		if st.removed || l.closed || st.sentEnd {
			l.mu.Unlock()
			return errStreamReset
		}
		// Take what the windows allow now, up to two frames, and send it
		// in one system call (see writeFrames).
		n := max(0, min(int64(len(p)), st.sendWindow, l.connSendWindow, 2*int64(l.peerMaxFrame)))
		st.sendWindow -= n
		l.connSendWindow -= n
		last := end && n == int64(len(p))
		if last {
			st.sentEnd = true
		}
		frame := int(l.peerMaxFrame)
		l.mu.Unlock()

		if err := l.writeFrames(st.id, p[:n], frame, last); err != nil {
			l.closeWith(fmt.Errorf("write: %w", err))
			return err
		}
		p = p[n:]
		if last {
			st.maybeRemove()
			return nil
		}
		if len(p) == 0 {
			return nil
		}
	}
}

// receive queues a DATA payload for the reader, or hands it straight to
// the stream's socket (see sink.go).
func (st *linkStream) receive(data []byte, flow int64) error {
	next, err := st.receiveLocked(data, flow)
	next()
	return err
}

func (st *linkStream) receiveLocked(data []byte, flow int64) (next func(), err error) {
	st.rmu.Lock()
	defer st.rmu.Unlock()
	st.recvWindow -= flow
	if st.recvWindow < 0 {
		return noop, fmt.Errorf("%w: the agent overran the stream window", errStreamReset)
	}
	if padding := flow - int64(len(data)); padding > 0 {
		st.unacked += padding // padding is never read: return its credit now
	}
	if len(data) == 0 || st.readerGone || st.recvErr != nil {
		st.unacked += int64(len(data))
		st.refillLocked()
		return noop, nil
	}
	if st.sink != nil {
		n, ferr := st.writeToSinkLocked(data)
		if ferr != nil {
			st.unacked += int64(len(data))
			st.refillLocked()
			return func() { st.sinkFailed(ferr) }, nil
		}
		st.unacked += int64(n)
		data = data[n:]
		if len(data) == 0 {
			st.refillLocked()
			return noop, nil
		}
	}
	// Small payloads share the last chunk while it has room, so a window
	// full of tiny frames costs its bytes, not a chunk each.
	if n := len(st.queue); n > 0 {
		if tail := st.queue[n-1]; cap(*tail)-len(*tail) >= len(data) {
			*tail = append(*tail, data...)
			st.recvCond.Broadcast()
			return st.sinkStepLocked(), nil
		}
	}
	b := getChunk(len(data))
	*b = append((*b)[:0], data...)
	st.queue = append(st.queue, b)
	st.recvCond.Broadcast()
	return st.sinkStepLocked(), nil
}

// refillLocked returns consumed credit to the agent in batches.
func (st *linkStream) refillLocked() {
	if st.unacked < st.link.window/4 { // a quarter: fewer WINDOW_UPDATEs, three quarters still in flight
		return
	}
	n := st.unacked
	st.unacked = 0
	st.recvWindow += n
	id := st.id
	st.link.writeControl(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(id, uint32(n)) })
}

// endRecv records END_STREAM from the agent.
func (st *linkStream) endRecv() {
	st.rmu.Lock()
	st.recvEnd = true
	st.recvCond.Broadcast()
	next := st.sinkStepLocked()
	st.rmu.Unlock()
	next()
	st.maybeRemove()
}

// maybeRemove removes the stream once both halves have ended.
func (st *linkStream) maybeRemove() {
	st.rmu.Lock()
	recvDone := st.recvEnd
	st.rmu.Unlock()
	l := st.link
	l.mu.Lock()
	done := st.sentEnd && recvDone
	l.mu.Unlock()
	if done {
		st.remove()
	}
}

// remove takes the stream off the link; idempotent.
func (st *linkStream) remove() {
	l := st.link
	l.mu.Lock()
	if st.removed {
		l.mu.Unlock()
		return
	}
	st.removed = true
	delete(l.streams, st.id)
	if l.idle != nil && len(l.streams) == 0 {
		select {
		case <-l.idle:
		default:
			close(l.idle)
		}
	}
	stop := st.stopCtx
	l.windowCond.Broadcast()
	l.mu.Unlock()
	if stop != nil {
		stop()
	}
	// Whoever still waits learns the stream is gone (a no-op once answered
	// and fully received).
	st.finish(errEndedUnanswered)
	st.closeBody()
}

// abort ends the handler's request context (the agent's end) when the
// stream ends abnormally. A stream that ended cleanly keeps it until the
// handler returns: after both END_STREAMs the handler may still be
// writing what it read to its destination.
func (st *linkStream) abort() {
	if st.cancelCtx != nil {
		st.cancelCtx()
	}
}

// closeBody tells the upload it is no longer read, once.
func (st *linkStream) closeBody() {
	if st.body == nil {
		return
	}
	l := st.link
	l.mu.Lock()
	done := st.bodyClosed
	st.bodyClosed = true
	l.mu.Unlock()
	if !done {
		st.body.Close()
	}
}

// fail ends the stream because of the link: no frame is sent.
func (st *linkStream) fail(err error) {
	st.finish(err)
	st.remove()
	st.abort()
}

// reset ends the stream from this side with RST_STREAM.
func (st *linkStream) reset(code http2.ErrCode, err error) {
	l := st.link
	l.mu.Lock()
	already := st.removed
	l.mu.Unlock()
	if already {
		return
	}
	st.finish(err)
	id := st.id
	l.writeControl(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, code) })
	st.remove()
	if code != http2.ErrCodeNo {
		st.abort()
	}
}

// resetByPeer handles RST_STREAM from the agent. After its END_STREAM a
// reset (NO_ERROR: "stop sending") loses nothing that was received.
func (st *linkStream) resetByPeer(code http2.ErrCode) {
	st.finish(fmt.Errorf("%w by the agent (%v)", errStreamReset, code))
	st.remove()
	st.abort()
}

// finish delivers err to whoever waits on the stream: the RoundTrip caller
// if no answer came yet, else the reader once it has read what arrived.
func (st *linkStream) finish(err error) {
	st.rmu.Lock()
	answered := st.resp != nil
	if !answered && st.respErr == nil {
		st.respErr = err
		close(st.respReady)
	}
	if !st.recvEnd && st.recvErr == nil {
		st.recvErr = err
	}
	st.recvCond.Broadcast()
	next := st.sinkStepLocked()
	st.rmu.Unlock()
	next()
}

// linkBody is the response body: the bytes the agent sends.
type linkBody struct {
	st *linkStream
}

func (b *linkBody) Read(p []byte) (int, error) {
	st := b.st
	st.rmu.Lock()
	defer st.rmu.Unlock()
	for len(st.queue) == 0 && !st.recvEnd && st.recvErr == nil && !st.readerGone {
		st.recvCond.Wait()
	}
	if st.readerGone {
		return 0, errors.New("read on a closed response body")
	}
	if len(st.queue) == 0 {
		if st.recvErr != nil {
			return 0, st.recvErr
		}
		return 0, io.EOF
	}
	n := 0
	for n < len(p) && len(st.queue) > 0 {
		chunk := *st.queue[0]
		c := copy(p[n:], chunk[st.head:])
		n += c
		st.head += c
		if st.head == len(chunk) {
			putChunk(st.queue[0])
			st.queue[0] = nil
			st.queue = st.queue[1:]
			st.head = 0
		}
	}
	if len(st.queue) == 0 {
		st.queue = nil // let the slice's array go while idle
	}
	st.unacked += int64(n)
	st.refillLocked()
	return n, nil
}

// WriteTo writes what the agent sends to w as it arrives, straight from the
// received chunks: no copy buffer, and none held while the stream is quiet.
// It returns nil at the stream's clean end.
func (b *linkBody) WriteTo(w io.Writer) (int64, error) {
	st := b.st
	var written int64
	for {
		st.rmu.Lock()
		for len(st.queue) == 0 && !st.recvEnd && st.recvErr == nil && !st.readerGone {
			st.recvCond.Wait()
		}
		if st.readerGone {
			st.rmu.Unlock()
			return written, errors.New("read on a closed response body")
		}
		if len(st.queue) == 0 {
			err := st.recvErr
			st.rmu.Unlock()
			return written, err // nil at END_STREAM
		}
		// Take everything queued: several chunks leave in one writev.
		chunks, head := st.queue, st.head
		st.queue, st.head = nil, 0
		st.rmu.Unlock()

		n, taken, err := writeChunks(w, chunks, head)
		written += n
		st.rmu.Lock()
		st.unacked += int64(taken) // off the queue, written or not: credit it all
		st.refillLocked()
		st.rmu.Unlock()
		if err != nil {
			return written, err
		}
	}
}

// Close stops reading; a stream still open is reset (CANCEL).
func (b *linkBody) Close() error {
	st := b.st
	st.rmu.Lock()
	if st.readerGone {
		st.rmu.Unlock()
		return nil
	}
	st.readerGone = true
	for _, c := range st.queue {
		putChunk(c)
	}
	st.queue, st.head = nil, 0
	complete := st.recvEnd
	st.recvCond.Broadcast()
	next := st.sinkStepLocked()
	st.rmu.Unlock()
	next()
	if st.link.handler != nil {
		// The agent's handler stops reading its request: what still comes
		// is dropped and credited, and its end says RST_STREAM(NO_ERROR).
		return nil
	}
	if complete {
		l := st.link
		l.mu.Lock()
		sent := st.sentEnd
		l.mu.Unlock()
		if sent {
			st.remove()
			return nil
		}
	}
	st.reset(http2.ErrCodeCancel, errStreamReset)
	return nil
}

// Received payloads are copied into pooled chunks: a small one for the
// short writes of interactive streams, a frame-sized one for bulk.
var (
	smallChunks = sync.Pool{New: func() any { b := make([]byte, 0, smallBufSize); return &b }}
	frameChunks = sync.Pool{New: func() any { b := make([]byte, 0, maxFrameSize); return &b }}
)

func getChunk(n int) *[]byte {
	if n <= smallBufSize {
		return smallChunks.Get().(*[]byte)
	}
	return frameChunks.Get().(*[]byte)
}

func putChunk(b *[]byte) {
	switch cap(*b) {
	case smallBufSize:
		smallChunks.Put(b)
	case maxFrameSize:
		frameChunks.Put(b)
	}
}

// --- the agent's end ---

// newAgentLink serves HTTP/2 on conn for the server at the other end, which
// opens the streams. It reads the client preface and sends this end's
// settings; serve then runs the read loop.
func newAgentLink(conn net.Conn, keepAlive, pingWait time.Duration, maxStreams uint32, handler http.Handler, baseCtx context.Context, spawn func(func())) (*link, error) {
	return newServingLink(conn, keepAlive, pingWait, maxStreams, streamWindow, handler, baseCtx, spawn)
}

// newServingLink is newAgentLink with the receive window given per stream.
func newServingLink(conn net.Conn, keepAlive, pingWait time.Duration, maxStreams uint32, window int64, handler http.Handler, baseCtx context.Context, spawn func(func())) (*link, error) {
	l := newLinkState(conn, keepAlive, pingWait, window, spawn)
	l.handler, l.baseCtx, l.maxStreams = handler, baseCtx, maxStreams

	preface := make([]byte, len(http2.ClientPreface))
	if keepAlive > 0 {
		conn.SetReadDeadline(time.Now().Add(keepAlive + pingWait))
	}
	if _, err := io.ReadFull(conn, preface); err != nil {
		return nil, fmt.Errorf("read HTTP/2 preface: %w", err)
	}
	conn.SetReadDeadline(time.Time{})
	if string(preface) != http2.ClientPreface {
		return nil, errors.New("not an HTTP/2 client preface")
	}
	l.armWrite()
	err := l.fr.WriteSettings(
		http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: maxStreams},
		http2.Setting{ID: http2.SettingInitialWindowSize, Val: uint32(window)},
		http2.Setting{ID: http2.SettingMaxFrameSize, Val: maxFrameSize},
	)
	if err == nil {
		err = l.fr.WriteWindowUpdate(0, linkConnWindow-initialPeerWindow)
	}
	if err != nil {
		return nil, fmt.Errorf("write HTTP/2 settings: %w", err)
	}
	return l, nil
}

// serve runs the read loop until the connection ends.
func (l *link) serve() {
	if l.keepAlive > 0 {
		l.mu.Lock()
		l.pingTimer = time.AfterFunc(l.keepAlive, l.keepAliveTick)
		l.mu.Unlock()
	}
	l.readLoop()
}

// goAwayNow tells the server this end opens nothing more and takes no new
// stream; the connection is closed by whoever ends it next.
func (l *link) goAwayNow() {
	l.mu.Lock()
	l.goAway = true
	last := l.lastPeerID
	l.mu.Unlock()
	// Written here rather than queued: the caller closes the connection next.
	l.lockWrite()
	err := l.fr.WriteGoAway(last, http2.ErrCodeNo, nil)
	l.unlockWrite()
	if err != nil {
		l.closeWith(fmt.Errorf("write: %w", err))
	}
}

// onRequest starts a stream the server opened.
func (l *link) onRequest(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	l.mu.Lock()
	if st := l.streams[id]; st != nil {
		// Trailers on an open request: only END_STREAM matters.
		l.mu.Unlock()
		if f.StreamEnded() {
			st.endRecv()
		}
		return nil
	}
	if id%2 == 0 || id <= l.lastPeerID {
		l.mu.Unlock()
		return fmt.Errorf("HEADERS on stream %d: not a new client stream", id)
	}
	l.lastPeerID = id
	if l.closed || l.goAway || uint32(len(l.streams)) >= l.maxStreams {
		l.mu.Unlock()
		l.writeControl(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeRefusedStream) })
		return nil
	}
	st := &linkStream{link: l, id: id, respReady: make(chan struct{}), sendWindow: int64(l.peerWindow), recvWindow: l.window}
	st.recvCond = sync.NewCond(&st.rmu)
	l.streams[id] = st
	l.mu.Unlock()

	ctx, cancel := context.WithCancel(l.baseCtx)
	st.cancelCtx = cancel
	authority := f.PseudoValue("authority")
	method := f.PseudoValue("method")
	path := f.PseudoValue("path")
	u := &url.URL{Host: authority}
	if method != http.MethodConnect {
		parsed, err := url.ParseRequestURI(path)
		if err != nil {
			st.reset(http2.ErrCodeProtocol, fmt.Errorf("%w: bad :path", errStreamReset))
			return nil
		}
		u = parsed
	}
	header := make(http.Header, len(f.RegularFields()))
	for _, hf := range f.RegularFields() {
		header.Add(hf.Name, hf.Value)
	}
	req := &http.Request{
		Method: method, URL: u, Host: authority, RequestURI: path,
		Proto: "HTTP/2.0", ProtoMajor: 2, Header: header, ContentLength: -1,
		Body: &linkBody{st: st}, RemoteAddr: l.conn.RemoteAddr().String(),
	}
	if f.StreamEnded() {
		st.recvEnd = true
	}
	req = req.WithContext(ctx)
	l.spawn(func() { l.runHandler(st, req) })
	return nil
}

// runHandler serves one stream. A handler that returns ends the response
// (END_STREAM, then RST_STREAM(NO_ERROR) if the server is still sending: it
// is not read any more); one that panics, as with http.ErrAbortHandler,
// resets the stream.
func (l *link) runHandler(st *linkStream, req *http.Request) {
	w := &linkResponse{st: st, header: make(http.Header)}
	completed := false
	defer st.abort() // the request context ends with the handler, as in net/http
	defer func() {
		if !completed {
			recover() // http.ErrAbortHandler, or a handler's own panic: this stream only
			st.reset(http2.ErrCodeInternal, errStreamReset)
			return
		}
		w.finish()
	}()
	l.handler.ServeHTTP(w, req)
	completed = true
}

// linkResponse is the http.ResponseWriter of a stream served by a link.
// As with net/http, the head is sent with the first Write or Flush, or when
// the handler returns: a handler that writes nothing ends the stream with
// that one HEADERS frame (gRPC's trailers-only answer). Header keys with
// http.TrailerPrefix, set before the handler returns, are sent as trailers.
// Every Write is sent at once.
type linkResponse struct {
	st          *linkStream
	header      http.Header
	status      int  // set by WriteHeader
	headersSent bool // the head has gone out
	err         error
}

func (w *linkResponse) Header() http.Header { return w.header }

func (w *linkResponse) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}

func (w *linkResponse) sendHead(end bool) error {
	if w.headersSent {
		return w.err
	}
	w.headersSent = true
	if w.status == 0 {
		w.status = http.StatusOK
	}
	head := make(http.Header, len(w.header))
	for k, v := range w.header {
		if !strings.HasPrefix(k, http.TrailerPrefix) && k != "Trailer" {
			head[k] = v
		}
	}
	w.err = w.st.writeHeaders(w.status, head, end)
	return w.err
}

func (w *linkResponse) Write(p []byte) (int, error) {
	if err := w.sendHead(false); err != nil {
		return 0, err
	}
	if err := w.st.writeData(p, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (w *linkResponse) Flush() { w.sendHead(false) }

// CloseWrite ends the response (END_STREAM) while the request is still
// read: the agent's half of a half-closed tunnel.
func (w *linkResponse) CloseWrite() error {
	if err := w.sendHead(false); err != nil {
		return err
	}
	return w.st.writeData(nil, true)
}

func (w *linkResponse) finish() {
	st := w.st
	trailers := make(http.Header)
	for k, v := range w.header {
		if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
			trailers[http.CanonicalHeaderKey(name)] = v
		}
	}
	st.link.mu.Lock()
	ended := st.sentEnd
	st.link.mu.Unlock()
	switch {
	case ended: // CloseWrite ended the response already
	case !w.headersSent && len(trailers) == 0:
		w.sendHead(true)
	case len(trailers) > 0:
		if w.sendHead(false) == nil {
			st.writeTrailers(trailers)
		}
	default:
		st.writeData(nil, true)
	}
	st.rmu.Lock()
	received := st.recvEnd
	st.rmu.Unlock()
	if !received {
		st.reset(http2.ErrCodeNo, errStreamReset)
		return
	}
	st.maybeRemove()
}

// writeTrailers ends the stream with a HEADERS frame of trailers.
func (st *linkStream) writeTrailers(trailers http.Header) error {
	return st.writeHeaderBlock(0, trailers, true)
}

// writeHeaders sends the response head, with END_STREAM if end is set.
func (st *linkStream) writeHeaders(code int, header http.Header, end bool) error {
	return st.writeHeaderBlock(code, header, end)
}

// writeHeaderBlock sends one HEADERS frame: a response head (code > 0) or
// trailers (code 0).
func (st *linkStream) writeHeaderBlock(code int, header http.Header, end bool) error {
	l := st.link
	l.mu.Lock()
	if st.removed || l.closed || st.sentEnd {
		l.mu.Unlock()
		return errStreamReset
	}
	if end {
		st.sentEnd = true
	}
	l.mu.Unlock()
	l.lockWrite()
	l.hbuf.Reset()
	if code > 0 {
		l.henc.WriteField(hpack.HeaderField{Name: ":status", Value: strconv.Itoa(code)})
	}
	for k, vs := range header {
		name := strings.ToLower(k)
		if name == "connection" || name == "transfer-encoding" || name == "keep-alive" {
			continue // connection-specific: not allowed in HTTP/2
		}
		for _, v := range vs {
			l.henc.WriteField(hpack.HeaderField{Name: name, Value: v})
		}
	}
	err := l.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: st.id, BlockFragment: l.hbuf.Bytes(), EndStream: end, EndHeaders: true})
	l.unlockWrite()
	if err != nil {
		l.closeWith(fmt.Errorf("write: %w", err))
		return err
	}
	if end {
		st.maybeRemove()
	}
	return nil
}
