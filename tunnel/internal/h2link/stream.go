package h2link

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http2"
)

// streamState is a stream's state as RFC 9113 §5.1 names it. A stream is
// in Conn.streams exactly while it is open or half-closed.
//
//	        send/recv HEADERS
//	idle ───────────────────────▶ open
//	                               │ send END_STREAM         │ recv END_STREAM
//	                               ▼                         ▼
//	                       half-closed (local)     half-closed (remote)
//	                               │ recv END_STREAM         │ send END_STREAM
//	                               └────────▶ closed ◀───────┘
//	                  (RST_STREAM sent or received, or the connection ends: closed)
type streamState uint8

const (
	stateIdle             streamState = iota // not yet opened: never in Conn.streams
	stateOpen                                // both sides may send
	stateHalfClosedLocal                     // this end sent END_STREAM
	stateHalfClosedRemote                    // the peer sent END_STREAM
	stateClosed                              // removed from Conn.streams
)

var stateNames = [...]string{"idle", "open", "half-closed (local)", "half-closed (remote)", "closed"}

func (s streamState) String() string { return stateNames[s] }

// stream is one stream on a Conn: a tunnel, a control stream, a gRPC call.
//
// Lock order: Conn.mu before rmu (see Conn).
type stream struct {
	// Immutable once the stream is published in Conn.streams.
	l         *Conn
	body      io.ReadCloser      // the client end: the upload; nil for a GET
	cancelCtx context.CancelFunc // the serving end: ends the handler's request context
	respReady chan struct{}      // the client end (nil on the serving end): closed once resp or respErr is set
	id        uint32

	// Guarded by Conn.mu. (The small fields first: they share a word with id.)
	state          streamState
	bodyClosed     bool        // body.Close was called
	handlerRunning bool        // the serving end: the handler has not returned
	counted        bool        // counts against MaxConcurrentStreams: open, or its handler still runs
	resetByThePeer bool        // the peer reset the stream while its handler ran
	answered       bool        // the serving end: the response head went out
	resetting      bool        // a RST_STREAM is on its way: the first reset's code is the one sent
	sendWindow     window      // what this end may still send
	stopCtx        func() bool // the client end: stops the request context's watch
	// The stream's place among the writers waiting for send credit (credit.go).
	sendCond    sync.Cond // on Conn.mu: the stream's writer waits here for send credit
	sendPrev    *stream   // the send queue's links
	sendNext    *stream
	inSendQueue bool // in Conn.sendQ[sendClass]
	sendClass   sendClass
	waitSince   int64 // when its writer began to wait for send credit (unix nanoseconds); 0 while it does not (stall.go)

	// Guarded by rmu: the receive side.
	rmu        sync.Mutex
	recvCond   *sync.Cond     // on rmu: bytes queued, EOF, error or reader gone
	resp       *http.Response // the client end: the answer, until RoundTrip takes it (see answeredRLocked)
	respErr    error          // the client end: why no answer comes
	queue      []*[]byte      // received payloads, oldest first
	head       int            // bytes of queue[0] already read
	queued     int64          // bytes received and not yet off the queue (written or read), counted in Config.Queued
	recvErr    error          // the stream was reset or the connection failed
	recvWindow window         // what the peer may still send
	unacked    int64          // consumed but not yet returned to the peer
	sink       *socketSink    // set by DeliverTo: bytes go straight to a socket
	notify     func()         // set by Notify: run once a Read would not block (never with sink)
	onWrite    func(n int)    // set by OnWrite: told of each write of the stream's bytes
	clen       *contentLength // the serving end: set when the request declared its length
	recvSize   int32          // the window this end gives the stream
	eof        bool           // END_STREAM received: the reader gets io.EOF after the queue
	readerGone bool           // the body was closed
	owedTold   bool           // the credit owed since owedSince was told (stall.go)
	owedSince  int64          // when a credit check first saw credit owed (unix nanoseconds); 0 while it is not
}

func newStream(l *Conn, id uint32, state streamState) *stream {
	st := &stream{l: l, id: id, state: state}
	if !l.serving {
		st.respReady = make(chan struct{})
	}
	st.sendWindow = window{int64(l.peerWindow)}
	st.sendCond.L = &l.mu
	st.recvWindow = window{int64(l.streamWindow)}
	st.recvSize = l.streamWindow
	st.recvCond = sync.NewCond(&st.rmu)
	return st
}

// contentLength is a request's declared length and the DATA received so
// far (RFC 9113 §8.1.1: they must match). Few requests on this link carry
// one, so the stream holds a pointer. Under the stream's rmu.
type contentLength struct{ declared, received int64 }

// endSendLocked moves the state on for END_STREAM sent; done means both
// halves ended and the caller removes the stream. The caller holds Conn.mu.
func (st *stream) endSendLocked() (done bool) {
	switch st.state {
	case stateOpen:
		st.state = stateHalfClosedLocal
	case stateHalfClosedRemote:
		return true
	}
	return false
}

// endRecvLocked is endSendLocked for END_STREAM received.
func (st *stream) endRecvLocked() (done bool) {
	switch st.state {
	case stateOpen:
		st.state = stateHalfClosedRemote
	case stateHalfClosedLocal:
		return true
	}
	return false
}

// sentEndLocked reports whether this end has sent END_STREAM or the stream
// is closed: nothing more may be sent. The caller holds Conn.mu.
func (st *stream) sentEndLocked() bool {
	return st.state == stateHalfClosedLocal || st.state == stateClosed
}

// --- the client end ---

// An upload is a request body that sends itself to the stream's writer
// instead of being read through a buffer of the link's: it can then hold
// no buffer while its source is quiet.
type upload interface {
	SendTo(w io.Writer) error
}

// A request body whose CallerSends reports true is sent by the caller of
// RoundTrip, through (*Body).SendUpload once it has the answer, on the
// goroutine it has anyway, rather than on one more per stream that waits
// through the dial. Only such an upload may park: its SendTo returns
// ErrUploadParked once its source is quiet, with the stream still open, and
// its owner calls SendUpload again when the source has bytes.
type callerSends interface{ CallerSends() bool }

func sentByCaller(body io.Reader) bool {
	b, ok := body.(callerSends)
	return ok && b.CallerSends()
}

// RoundTrip opens one stream: a CONNECT tunnel (req.Body is the upload) or
// a GET. It returns once the peer answered. The request's context ends the
// stream at any time. On the client end only.
func (l *Conn) RoundTrip(req *http.Request) (*http.Response, error) {
	if l.serving {
		return nil, fmt.Errorf("RoundTrip on the serving end of %s", l.conn.RemoteAddr())
	}
	ctx := req.Context()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	noBody := req.Body == nil

	// The dial's deadline bounds the wait for the write lock too; a lock
	// taken by a write that does not drain sends the dial elsewhere.
	if err := l.wmu.lockContext(ctx, l.cfg.StallAfter); err != nil {
		return nil, err
	}
	l.mu.Lock()
	switch {
	case l.closed:
		l.mu.Unlock()
		l.wmu.Unlock()
		return nil, l.closeErr
	case l.goAway:
		l.mu.Unlock()
		l.wmu.Unlock()
		return nil, ErrGoAway
	}
	if l.nextID > maxStreamID {
		// A billion dials on one connection: its stream IDs are spent.
		l.mu.Unlock()
		l.wmu.Unlock()
		l.retire()
		return nil, ErrGoAway
	}
	state := stateOpen
	if noBody {
		state = stateHalfClosedLocal
	}
	st := newStream(l, l.nextID, state)
	st.body = req.Body
	l.nextID += 2
	l.streams[st.id] = st
	l.capacityChangedLocked()
	l.mu.Unlock()

	l.hbuf.Reset()
	l.henc.WriteField(hf(":method", req.Method))
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	l.henc.WriteField(hf(":authority", host))
	if req.Method != http.MethodConnect {
		l.henc.WriteField(hf(":scheme", "https"))
		l.henc.WriteField(hf(":path", req.URL.RequestURI()))
	}
	for k, vs := range req.Header { // none on a plain dial
		name := strings.ToLower(k)
		if connectionSpecific[name] {
			continue
		}
		for _, v := range vs {
			l.henc.WriteField(hf(name, v))
		}
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
		l.cfg.Spawn(st.pumpUpload)
	}
	select {
	case <-st.respReady:
	case <-ctx.Done():
		st.reset(http2.ErrCodeCancel, ctx.Err())
		return nil, ctx.Err()
	}
	st.rmu.Lock()
	resp, respErr := st.resp, st.respErr
	st.resp = nil // the caller's now: a long stream holds no answer it was given
	st.rmu.Unlock()
	if resp == nil {
		return nil, respErr
	}
	// Ending the request's context ends the stream, as with net/http.
	stop := context.AfterFunc(ctx, func() { st.reset(http2.ErrCodeCancel, context.Canceled) })
	l.mu.Lock()
	st.stopCtx = stop
	gone := st.state == stateClosed
	l.mu.Unlock()
	if gone {
		stop()
	}
	return resp, nil
}

// pumpUpload copies the request body into DATA frames, or as much of it
// as its source has when the upload parks (ErrUploadParked): then the
// stream stays as it is for the next SendUpload. (The copy through a
// buffer is a function of its own so that the frames of a tunnel parked
// in SendTo stay small.)
func (st *stream) pumpUpload() {
	var err error
	if u, ok := st.body.(upload); ok {
		err = u.SendTo(streamWriter{st})
	} else {
		err = st.copyUpload()
	}
	if err == ErrUploadParked {
		return
	}
	st.closeBody()
	if err != nil {
		st.uploadFailed(err)
		return
	}
	st.writeData(nil, true)
}

// uploadFailed resets the stream after its upload failed, unless the upload
// stopped (ErrUploadStopped): then the stream stays open for the caller,
// which moves the tunnel elsewhere. Apart from pumpUpload, whose frame
// stays on parked stacks.
//
//go:noinline
func (st *stream) uploadFailed(err error) {
	if errors.Is(err, ErrUploadStopped) {
		return
	}
	st.reset(http2.ErrCodeCancel, fmt.Errorf("%w: upload: %v", ErrStreamReset, err))
}

// copyUpload copies a body that is not an upload through a pooled buffer.
func (st *stream) copyUpload() error {
	buf := getChunk(MaxFrameSize)
	defer putChunk(buf)
	_, err := io.CopyBuffer(streamWriter{st}, onlyReader{st.body}, (*buf)[:MaxFrameSize])
	return err
}

// onlyReader hides a body's WriteTo, so io.CopyBuffer uses the buffer.
type onlyReader struct{ io.Reader }

// streamWriter writes DATA frames on a stream.
type streamWriter struct{ st *stream }

func (w streamWriter) Write(p []byte) (int, error) {
	if err := w.st.writeData(p, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

// writeData sends p as DATA frames within the flow-control windows, the
// last one with END_STREAM when end is set.
func (st *stream) writeData(p []byte, end bool) error {
	l := st.l
	bulk := len(p) > smallWrite // a small write goes ahead of bulk turns (sched.go)
	for {
		l.mu.Lock()
		for st.state != stateClosed && !l.closed && len(p) > 0 && !st.mayTakeLocked(classOf(bulk)) {
			st.waitingLocked() // for the credit checks and the status (stall.go)
			st.sendCond.Wait() // credit.go says who wakes it
		}
		st.goesOnLocked(classOf(bulk))
		if l.closed || st.sentEndLocked() {
			l.leaveSendQueueLocked(st)
			l.mu.Unlock()
			return ErrStreamReset
		}
		// Take what the windows allow now, up to two frames and one turn,
		// and send it in one system call (see writeFrames).
		n := max(0, min(int64(len(p)), st.sendWindow.avail(), l.connAvailLocked(bulk), 2*int64(l.peerMaxFrame), l.turnBytes()))
		st.sendWindow.take(n)
		l.sendWindow.take(n)
		l.bdp.wrote += n
		l.leaveSendQueueLocked(st) // served: the next in line takes what is left
		last := end && n == int64(len(p))
		done := false
		if last {
			done = st.endSendLocked()
		}
		frame := int(l.peerMaxFrame)
		l.mu.Unlock()

		if err := l.writeFrames(st.id, p[:n], frame, last, bulk); err != nil {
			l.closeWith(fmt.Errorf("write: %w", err))
			return err
		}
		p = p[n:]
		if last {
			if done {
				st.remove()
			}
			return nil
		}
		if len(p) == 0 {
			return nil
		}
	}
}

// --- both ends ---

// receive queues a DATA payload for the reader, or gives it straight to
// the stream's socket (see sink.go).
func (st *stream) receive(data []byte, flow int64) error {
	st.rmu.Lock()
	next, err := st.receiveRLocked(data, flow)
	st.rmu.Unlock()
	next()
	return err
}

// answeredRLocked reports whether the client end's answer came: resp was
// set, and RoundTrip may have taken it since. The caller holds rmu.
func (st *stream) answeredRLocked() bool {
	if st.respErr != nil {
		return false
	}
	select {
	case <-st.respReady:
		return true
	default:
		return false
	}
}

// receiveRLocked is receive's part under rmu, which the caller holds; what
// it returns runs once rmu is released.
func (st *stream) receiveRLocked(data []byte, flow int64) (next func(), err error) {
	if !st.l.serving && !st.answeredRLocked() {
		return noop, fmt.Errorf("%w: DATA before the answer", ErrStreamReset)
	}
	st.recvWindow.take(flow)
	if st.recvWindow.avail() < 0 {
		return noop, http2.StreamError{StreamID: st.id, Code: http2.ErrCodeFlowControl, Cause: fmt.Errorf("the peer overran the stream window")}
	}
	if c := st.clen; c != nil {
		c.received += int64(len(data))
		if c.received > c.declared {
			return noop, http2.StreamError{StreamID: st.id, Code: http2.ErrCodeProtocol, Cause: fmt.Errorf("more DATA than content-length")}
		}
	}
	if padding := flow - int64(len(data)); padding > 0 {
		st.unacked += padding // padding is never read: return its credit now
	}
	if len(data) == 0 || st.readerGone || st.recvErr != nil {
		st.unacked += int64(len(data))
		st.refillRLocked()
		return noop, nil
	}
	if st.sink != nil {
		n, ferr := st.writeToSinkRLocked(data)
		if ferr != nil {
			st.unacked += int64(len(data))
			st.refillRLocked()
			return func() { st.sinkFailed(ferr) }, nil
		}
		st.unacked += int64(n)
		data = data[n:]
		if len(data) == 0 {
			st.refillRLocked()
			return noop, nil
		}
	}
	// Small payloads share the last chunk while it has room, so a window
	// full of tiny frames costs its bytes, not a chunk each.
	st.queuedRLocked(int64(len(data)))
	if n := len(st.queue); n > 0 {
		if tail := st.queue[n-1]; cap(*tail)-len(*tail) >= len(data) {
			*tail = append(*tail, data...)
			return st.wakeRLocked(), nil
		}
	}
	b := getChunk(len(data))
	*b = append((*b)[:0], data...)
	st.queue = append(st.queue, b)
	return st.wakeRLocked(), nil
}

// wakeRLocked tells the reader that the receive side changed (bytes
// queued, END_STREAM, reset, reader gone, reading stopped): a Read blocked
// on recvCond wakes, and a socket delivery moves on, or a reader waiting
// through Notify is told. It returns what must run once rmu is released.
func (st *stream) wakeRLocked() func() {
	st.recvCond.Broadcast()
	if f := st.notify; f != nil && st.readableRLocked() {
		st.notify = nil
		return f
	}
	return st.sinkStepRLocked()
}

// readableRLocked reports whether a Read would return without waiting.
func (st *stream) readableRLocked() bool {
	return len(st.queue) > 0 || st.eof || st.recvErr != nil || st.readerGone || st.l.readStopped()
}

// queuedRLocked counts n bytes more (fewer, when negative) queued in the
// stream, and in Config.Queued. The caller holds rmu.
func (st *stream) queuedRLocked(n int64) {
	st.queued += n
	if q := st.l.cfg.Queued; q != nil {
		q.Add(n)
	}
}

// dropQueueRLocked lets go of what is queued, unread. The caller holds rmu.
func (st *stream) dropQueueRLocked() {
	dropped := -st.head
	for _, c := range st.queue {
		dropped += len(*c)
		putChunk(c)
	}
	st.queue, st.head = nil, 0
	st.queuedRLocked(-int64(dropped))
}

// refillRLocked returns consumed credit to the peer in batches; the caller
// holds rmu.
func (st *stream) refillRLocked() {
	if t := st.l.streamTarget.Load(); t != st.recvSize {
		// The link's speed moved the window (bdp.go): more credit goes
		// back now, or less until the peer's window is down to it.
		st.unacked += int64(t - st.recvSize)
		st.recvSize = t
	}
	if st.unacked < int64(st.recvSize)/4 { // a quarter: fewer WINDOW_UPDATEs, three quarters still in flight
		return
	}
	n := st.unacked
	st.unacked = 0
	st.recvWindow.add(n)
	st.l.writeControl(st.l.streamCredit(st.id, uint32(n)))
}

// endRecv records END_STREAM from the peer.
func (st *stream) endRecv() {
	st.rmu.Lock()
	if c := st.clen; c != nil && c.received != c.declared {
		st.rmu.Unlock()
		st.reset(http2.ErrCodeProtocol, fmt.Errorf("%w: DATA did not match content-length", ErrStreamReset))
		return
	}
	st.eof = true
	next := st.wakeRLocked()
	st.rmu.Unlock()
	next()
	l := st.l
	l.mu.Lock()
	done := st.endRecvLocked()
	l.mu.Unlock()
	if done {
		st.remove()
	}
}

// remove closes the stream and takes it off the connection; idempotent.
func (st *stream) remove() {
	l := st.l
	l.mu.Lock()
	if st.state == stateClosed {
		l.mu.Unlock()
		return
	}
	st.state = stateClosed
	delete(l.streams, st.id)
	l.capacityChangedLocked()
	if !st.handlerRunning {
		st.uncountLocked()
	}
	l.restChangedLocked()
	if l.idle != nil && len(l.streams) == 0 {
		select {
		case <-l.idle:
		default:
			close(l.idle)
		}
	}
	stop := st.stopCtx
	l.leaveSendQueueLocked(st)
	st.sendCond.Broadcast() // its writer, if one waits, learns it ended
	l.mu.Unlock()
	if stop != nil {
		stop()
	}
	// Whoever still waits learns the stream is gone (a no-op once answered
	// and fully received).
	st.finish(errEndedUnanswered)
	st.closeBody()
}

// uncountLocked frees the stream's place under MaxConcurrentStreams; the
// caller holds Conn.mu.
func (st *stream) uncountLocked() {
	if st.counted {
		st.counted = false
		st.l.counted--
	}
}

// abort ends the handler's request context (the serving end) when the
// stream ends abnormally. A stream that ended cleanly keeps it until the
// handler returns: after both END_STREAMs the handler may still be
// writing what it read to its destination.
func (st *stream) abort() {
	if st.cancelCtx != nil {
		st.cancelCtx()
	}
}

// closeBody tells the upload it is no longer read, once.
func (st *stream) closeBody() {
	if st.body == nil {
		return
	}
	l := st.l
	l.mu.Lock()
	done := st.bodyClosed
	st.bodyClosed = true
	l.mu.Unlock()
	if !done {
		st.body.Close()
	}
}

// fail ends the stream because of the connection: no frame is sent.
func (st *stream) fail(err error) {
	st.finish(err)
	st.remove()
	st.abort()
}

// reset ends the stream from this side with RST_STREAM; sent is false if
// it had ended already, and nothing was sent.
func (st *stream) reset(code http2.ErrCode, err error) (sent bool) {
	l := st.l
	l.mu.Lock()
	already := st.state == stateClosed || st.resetting
	st.resetting = true
	l.mu.Unlock()
	if already {
		return false
	}
	st.finish(err)
	id := st.id
	l.writeControl(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, code) })
	st.remove()
	if code != http2.ErrCodeNo {
		st.abort()
	}
	return true
}

// resetByPeer handles RST_STREAM from the peer. After its END_STREAM a
// reset (NO_ERROR: "stop sending") loses nothing that was received. On
// the serving end a reset of a stream whose handler still runs and has not
// answered yet (the work a rapid reset wastes: a dial, a login) is charged
// to the rapid-reset budget; exhausted reports it empty. A tunnel the peer
// ends after its answer costs nothing.
func (st *stream) resetByPeer(code http2.ErrCode) (exhausted bool) {
	l := st.l
	if l.serving {
		l.mu.Lock()
		if st.handlerRunning && !st.answered && !st.resetByThePeer {
			st.resetByThePeer = true
			exhausted = l.chargeResetLocked()
		}
		l.mu.Unlock()
	}
	st.finish(fmt.Errorf("%w by the peer (%v)", ErrStreamReset, code))
	st.remove()
	st.abort()
	return exhausted
}

// chargeResetLocked takes one from the rapid-reset budget, after adding
// one per second since the last charge, and reports an empty budget. The
// caller holds mu.
func (l *Conn) chargeResetLocked() (exhausted bool) {
	now := time.Now()
	if earned := int(now.Sub(l.budgetAt) / time.Second); earned > 0 {
		l.resetBudget = min(l.cfg.MaxPeerResets, l.resetBudget+earned)
		l.budgetAt = now
	}
	l.resetBudget--
	return l.resetBudget < 0
}

// finish delivers err to whoever waits on the stream: the RoundTrip caller
// if no answer came yet, else the reader once it has read what arrived.
func (st *stream) finish(err error) {
	st.rmu.Lock()
	if st.respReady != nil && !st.answeredRLocked() && st.respErr == nil {
		st.respErr = err
		close(st.respReady)
	}
	if !st.eof && st.recvErr == nil {
		st.recvErr = err
	}
	next := st.wakeRLocked()
	st.rmu.Unlock()
	next()
}
