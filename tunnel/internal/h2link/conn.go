package h2link

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
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"golang.org/x/sys/unix"
)

// Conn is one HTTP/2 connection in either role: the client end
// (NewClient), whose RoundTrip opens streams, or the serving end
// (NewServer), which runs a handler for each stream the peer opens.
//
// Lock order, outermost first: wmu, mu, a stream's rmu, ctlMu. wmu is a
// writeLock, given in turn (sched.go); its own lock and the
// Batcher's are leaves, the Batcher's taken only inside a write, under wmu. No read from the connection runs under a lock; a write to it runs
// under wmu alone. The read loop takes no lock a write runs
// under (wmu), so a peer that does not read cannot stall it:
// the frames it must answer with go through the control queue.
type Conn struct {
	// Immutable after the constructor.
	conn     net.Conn
	cfg      Config
	serving  bool            // the serving end: the peer opens the streams
	handler  http.Handler    // the serving end: serves each stream
	batch    *Batcher        // gathers a write's records into one system call; may be nil
	writeTTL time.Duration   // a write that makes no progress this long breaks the connection
	tcp      syscall.RawConn // the TCP socket under conn, for its unsent bound; nil if none

	// turn is the most a bulk turn writes (sched.go): set under wmu, read
	// by writers before they take it.
	turn atomic.Int64
	pace pacing // under wmu: how long turns take, which sets turn

	// fr reads on the read loop only; it writes under wmu.
	fr *http2.Framer

	wmu  writeLock      // taken for every frame written, and across a header block's encoding (sched.go, wlock.go)
	henc *hpack.Encoder // under wmu
	hbuf bytes.Buffer   // under wmu: the header block being encoded

	ctlMu       sync.Mutex
	ctlQueue    []func(*http2.Framer) error // under ctlMu: control frames not yet written
	ctlFlushing bool                        // under ctlMu: a flusher goroutine runs
	ctlClosed   bool                        // under ctlMu: the connection is closed, nothing more is queued
	flushers    sync.WaitGroup              // flusher goroutines; the read loop waits for them
	ctlOverflow atomic.Bool                 // the queue hit MaxQueuedControl: the read loop ends the connection

	mu        sync.Mutex
	sendQ     [2]sendQueue       // under mu: writers waiting for connection credit, by class (credit.go)
	streams   map[uint32]*stream // under mu: streams not yet closed
	closed    bool               // under mu
	closeErr  error              // under mu: why, once closed
	goAway    bool               // under mu: no new streams; we or the peer said GOAWAY
	retiring  bool               // under mu: stream IDs ran out: see retire
	idle      chan struct{}      // under mu: closed when goAway is set and no stream is left
	goAwayWhy []byte             // under mu: the debug data of this end's GOAWAY (SetGoAwayDebug)
	peerWhy   string             // under mu: the debug data of the peer's GOAWAY (PeerGoAwayDebug)

	peerMaxStreams uint32 // under mu: the peer's SETTINGS_MAX_CONCURRENT_STREAMS
	// canTake is CanTakeNewRequest's answer, written under mu by
	// capacityChangedLocked whenever a field it depends on changes, so that
	// a caller choosing among thousands of links reads it without mu.
	canTake      atomic.Bool
	peerWindow   int32        // under mu: the peer's SETTINGS_INITIAL_WINDOW_SIZE
	peerMaxFrame uint32       // under mu: the peer's SETTINGS_MAX_FRAME_SIZE
	sendWindow   window       // under mu: the connection's send window
	recvWindow   window       // under mu: what the peer may still send on the connection
	recvUnacked  int64        // under mu: connection credit not yet returned
	recvTarget   int32        // under mu: the connection window this end wants the peer to have (bdp.go)
	streamWindow int32        // under mu: the receive window each new stream gets (SETTINGS_INITIAL_WINDOW_SIZE)
	sendPeak     int64        // under mu: the largest connection send window seen: see connAvailLocked
	bdp          bdpEstimator // under mu: the link's measurement, which sets recvTarget
	watch        creditWatch  // under mu: what the credit checks keep (stall.go)

	// streamTarget is the receive window streams move to as their credit
	// goes back (bdp.go): written under mu, read under a stream's rmu.
	streamTarget atomic.Int32

	// The client end only; under mu.
	nextID uint32 // the next stream this end opens

	// The serving end only; under mu.
	lastPeerID  uint32    // the highest stream the peer opened
	counted     int       // streams counting against MaxConcurrentStreams (see stream.counted)
	resetBudget int       // rapid-reset budget: see Config.MaxPeerResets
	budgetAt    time.Time // when resetBudget last earned its per-second refill

	lastRead   atomic.Int64  // unix nanoseconds of the last frame read
	pingTimer  *time.Timer   // under mu once set; fires keepAliveTick
	pingData   [8]byte       // under mu: the outstanding PING's payload
	pingOut    bool          // under mu: a PING is outstanding
	pingDue    time.Time     // under mu: when the outstanding PING's answer is due (see Probe)
	probeSent  time.Time     // under mu: when Probe sent the outstanding PING; zero for a keepalive's
	readerDone chan struct{} // closed when the read loop ended

	// A freezable serving end (Config.Freezable, freeze.go); nil otherwise.
	fread      *frameReader  // the read loop's reader
	readParked chan struct{} // closed when the read loop stopped for a freeze
	frozen     chan struct{} // closed by Freeze or closeWith: the parked read loop returns
	rest       chan struct{} // under mu, made by WaitAtRest: closed when a handler returns or a stream leaves
	resumed    []func()      // ResumeServer's handlers of frozen streams; Serve starts them
}

// Errors of the link. A dial that meets ErrClosed or ErrGoAway before the
// peer answered may be retried elsewhere: the peer saw nothing of it.
var (
	ErrClosed      = errors.New("connection closed")
	ErrGoAway      = errors.New("connection is going away")
	ErrStreamReset = errors.New("stream reset")
	// ErrUploadStopped, from an upload's SendTo, stops sending it without
	// END_STREAM or RST_STREAM: the stream stays open.
	ErrUploadStopped = errors.New("upload stopped")
	// ErrUploadParked, from the SendTo of an upload its caller sends,
	// says its source is quiet: SendUpload returns with the stream as it
	// is, and the caller calls it again once the source has bytes.
	ErrUploadParked = errors.New("upload parked until its source has bytes")
	errPingTimeout  = errors.New("no answer to PING")
	errCalm         = errors.New("peer exceeded a limit (ENHANCE_YOUR_CALM)")

	// What remove tells a caller still waiting for the answer; made once,
	// as every stream's end passes it (a no-op for the answered ones).
	errEndedUnanswered = fmt.Errorf("%w: the stream ended before the peer answered", ErrStreamReset)
)

// NewClient starts the client end of HTTP/2 on conn, and its read loop
// through cfg.Spawn: RoundTrip then opens streams.
func NewClient(conn net.Conn, cfg Config) (*Conn, error) {
	l := newConn(conn, cfg, false)
	l.nextID = 1
	l.capacityChangedLocked()

	l.armWrite()
	err := l.batched(func() error {
		if _, err := conn.Write(slices.Concat(cfg.Prelude, []byte(http2.ClientPreface))); err != nil {
			return fmt.Errorf("write HTTP/2 preface: %w", err)
		}
		return l.writeSettings()
	})
	if err != nil {
		return nil, err
	}
	if l.cfg.KeepAlive > 0 {
		l.pingTimer = time.AfterFunc(l.cfg.KeepAlive, l.keepAliveTick)
	}
	l.cfg.Spawn(l.readLoop)
	return l, nil
}

// NewServer is the serving end of HTTP/2 on conn: it reads the client
// preface and sends this end's settings; Serve then runs the read loop,
// and handler (or the one Config.Take chooses) serves each stream the peer
// opens on a goroutine of its own.
func NewServer(conn net.Conn, cfg Config, handler http.Handler) (*Conn, error) {
	l := newConn(conn, cfg, true)
	l.handler = handler
	l.resetBudget = l.cfg.MaxPeerResets
	l.budgetAt = time.Now()

	preface := make([]byte, len(http2.ClientPreface))
	if l.writeTTL > 0 {
		conn.SetReadDeadline(time.Now().Add(l.writeTTL))
	}
	if _, err := io.ReadFull(conn, preface); err != nil {
		return nil, fmt.Errorf("read HTTP/2 preface: %w", err)
	}
	conn.SetReadDeadline(time.Time{})
	if string(preface) != http2.ClientPreface {
		return nil, errors.New("not an HTTP/2 client preface")
	}
	l.armWrite()
	if err := l.batched(l.writeSettings); err != nil {
		return nil, err
	}
	return l, nil
}

func newConn(conn net.Conn, cfg Config, serving bool) *Conn {
	cfg = cfg.withDefaults()
	cfg.Prelude = nil // sent once by NewClient, not stored for the link's life
	l := &Conn{
		conn:           conn,
		cfg:            cfg,
		serving:        serving,
		batch:          cfg.Batch,
		writeTTL:       cfg.KeepAlive + cfg.PingTimeout,
		streams:        make(map[uint32]*stream),
		peerMaxStreams: math.MaxUint32,
		peerWindow:     initialWindow,
		peerMaxFrame:   initialFrame,
		sendWindow:     window{initialWindow},
		recvWindow:     window{initialWindow},
		recvTarget:     cfg.ConnWindow,
		streamWindow:   cfg.StreamWindow,
		readerDone:     make(chan struct{}),
	}
	preAdmit := serving && (cfg.PreAdmitConnWindow < cfg.ConnWindow || cfg.PreAdmitStreamWindow < cfg.StreamWindow)
	if preAdmit {
		l.recvTarget, l.streamWindow = cfg.PreAdmitConnWindow, cfg.PreAdmitStreamWindow
	} else {
		l.recvTarget = min(cfg.ConnWindow, startConnWindow)
		l.bdp.on = true
	}
	l.streamTarget.Store(l.streamWindow)
	l.turn.Store(maxTurn)
	l.tcp = tcpSocket(conn, cfg.Batch)
	l.setUnsentBound(unsentBound(maxTurn))
	if serving && cfg.Freezable {
		l.fread = &frameReader{conn: conn}
		l.readParked, l.frozen = make(chan struct{}), make(chan struct{})
		l.fr = http2.NewFramer(conn, l.fread)
	} else {
		l.fr = http2.NewFramer(conn, conn)
	}
	l.fr.SetMaxReadFrameSize(MaxFrameSize)
	l.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	l.fr.MaxHeaderListSize = cfg.MaxHeaderListSize
	l.henc = hpack.NewEncoder(&l.hbuf)
	l.lastRead.Store(time.Now().UnixNano())
	l.capacityChangedLocked()
	return l
}

// writeSettings sends this end's SETTINGS and opens the connection window;
// the constructors call it before any other goroutine writes.
func (l *Conn) writeSettings() error {
	settings := []http2.Setting{
		{ID: http2.SettingInitialWindowSize, Val: uint32(l.streamWindow)},
		{ID: http2.SettingMaxFrameSize, Val: MaxFrameSize},
		{ID: http2.SettingMaxHeaderListSize, Val: l.cfg.MaxHeaderListSize},
	}
	if l.serving {
		settings = append(settings, http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: l.cfg.MaxConcurrentStreams})
	} else {
		settings = append(settings, http2.Setting{ID: http2.SettingEnablePush, Val: 0})
	}
	err := l.fr.WriteSettings(settings...)
	if err == nil && l.recvTarget > initialWindow {
		err = l.fr.WriteWindowUpdate(0, uint32(l.recvTarget-initialWindow))
		l.recvWindow.add(int64(l.recvTarget - initialWindow))
	}
	if err != nil {
		return fmt.Errorf("write HTTP/2 settings: %w", err)
	}
	return nil
}

// RaiseWindows gives a peer the full receive windows (Config.StreamWindow,
// and the connection's starting window, which then follows the link:
// bdp.go) on a serving end that started with the pre-admission ones:
// SETTINGS_INITIAL_WINDOW_SIZE, and a WINDOW_UPDATE for the connection and
// for each open stream. The owner calls it once it has
// admitted the peer; again, or without pre-admission windows, it does
// nothing. A handler may call it: NewServer returns before any handler
// runs (they start with Serve), so the handler can use the *Conn its
// owner stored from NewServer's result.
func (l *Conn) RaiseWindows() {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	if l.bdp.on {
		l.mu.Unlock()
		return
	}
	start := min(l.cfg.ConnWindow, startConnWindow)
	connDelta := int64(start - l.recvTarget)
	streamDelta := int64(l.cfg.StreamWindow - l.streamWindow)
	l.recvTarget, l.streamWindow = start, l.cfg.StreamWindow
	l.recvWindow.add(connDelta)
	l.bdp.on = true
	l.streamTarget.Store(l.streamWindow)
	open := make([]*stream, 0, len(l.streams))
	for _, st := range l.streams {
		open = append(open, st)
	}
	l.mu.Unlock()
	if streamDelta > 0 {
		val := uint32(l.cfg.StreamWindow)
		l.writeControl(func(fr *http2.Framer) error {
			return fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: val})
		})
		for _, st := range open {
			// The peer adds the delta to the open streams' windows itself
			// (§6.9.2); only this end's account of them grows here.
			st.rmu.Lock()
			st.recvWindow.add(streamDelta)
			st.recvSize += int32(streamDelta)
			st.rmu.Unlock()
		}
	}
	if connDelta > 0 {
		l.writeControl(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, uint32(connDelta)) })
	}
}

// --- writing ---

// lockWrite takes wmu and arms the write deadline.
func (l *Conn) lockWrite() {
	l.wmu.Lock()
	l.armWrite()
}

// armWrite bounds the next write: a peer that stops reading breaks the
// connection instead of holding a writer forever.
func (l *Conn) armWrite() {
	if l.writeTTL > 0 {
		l.conn.SetWriteDeadline(time.Now().Add(l.writeTTL))
	}
}

// unlockWrite sends the control frames queued meanwhile, then releases
// wmu, which the caller holds.
func (l *Conn) unlockWrite() {
	err := l.flushControlWLocked()
	l.wmu.Unlock()
	if err != nil {
		l.closeWith(fmt.Errorf("write: %w", err))
	}
}

// flushControlWLocked writes the queued control frames; the caller holds wmu.
func (l *Conn) flushControlWLocked() error {
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
// for the peer to read, and callers under a stream's rmu. A flusher
// goroutine, one at a time, sends the queue unless a data writer holding
// wmu sends it first. A queue past Config.MaxQueuedControl means a peer
// that makes this end answer but does not read: the connection is closed.
func (l *Conn) writeControl(f func(*http2.Framer) error) {
	l.ctlMu.Lock()
	if l.ctlClosed {
		l.ctlMu.Unlock()
		return
	}
	if len(l.ctlQueue) >= l.cfg.MaxQueuedControl {
		// Callers may hold a stream's rmu: the read loop, which checks
		// this flag after every frame, ends the connection.
		l.ctlOverflow.Store(true)
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
func (l *Conn) flushControl() {
	defer l.flushers.Done()
	for {
		l.lockWrite()
		err := l.batched(l.flushControlWLocked) // all queued frames in one system call
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

// batched runs write, which holds wmu, with the records it makes gathered
// into one system call (see Batcher).
func (l *Conn) batched(write func() error) error {
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

// writeFrames writes p as DATA frames of at most frame bytes, the last with
// END_STREAM when end is set, in one turn of the write lock (sched.go):
// bulk turns wait behind small writes, and their time paces the next.
// Under a Batcher the frames leave in one write.
func (l *Conn) writeFrames(id uint32, p []byte, frame int, end, bulk bool) error {
	l.wmu.lock(bulk)
	l.armWrite()
	start := time.Now()
	n := int64(len(p))
	err := l.batched(func() error {
		for first := true; first || len(p) > 0; first = false {
			n := min(len(p), frame)
			if err := l.fr.WriteData(id, end && n == len(p), p[:n]); err != nil {
				return err
			}
			p = p[n:]
		}
		return l.flushControlWLocked() // queued WINDOW_UPDATEs ride along
	})
	if err == nil && bulk {
		// The link's part of the turn: the system calls, not the
		// encryption before them, which a busy machine slows too.
		took := time.Since(start)
		if l.batch != nil {
			took = l.batch.spentWriting()
		}
		l.paceWLocked(n, took)
	}
	l.wmu.Unlock()
	return err
}

// --- the client end ---

// HTTP/2 stream IDs are 31 bits; the client's are odd.
const maxStreamID = 1<<31 - 1

// retireGrace bounds how long a connection whose stream IDs ran out keeps
// its open streams before it is closed and the peer dials a fresh one.
const retireGrace = time.Minute

// retire ends a connection that can open no more streams: GOAWAY now (new
// dials go elsewhere), close once its streams ended or after retireGrace.
func (l *Conn) retire() {
	l.mu.Lock()
	first := !l.retiring
	l.retiring = true
	l.mu.Unlock()
	if !first {
		return
	}
	l.cfg.Spawn(func() {
		ctx, cancel := context.WithTimeout(context.Background(), retireGrace)
		defer cancel()
		if l.Shutdown(ctx) != nil {
			l.Close()
		}
	})
}

// CanTakeNewRequest reports whether a new stream may be opened now: not
// on a connection that is closed, going away or full, nor on one whose
// writes have not drained for Config.StallAfter (Stalled). It takes no
// lock: a server's agent choice asks it of many links per dial.
func (l *Conn) CanTakeNewRequest() bool { return l.canTake.Load() && !l.Stalled() }

// Stalled reports whether a write to the connection has been under way
// for longer than Config.StallAfter: the peer does not read. The write
// deadline (KeepAlive + PingTimeout) closes such a connection.
func (l *Conn) Stalled() bool {
	return l.cfg.StallAfter > 0 && l.wmu.takenFor(time.Now()) > l.cfg.StallAfter
}

// capacityChangedLocked recomputes canTake; every change to closed, goAway,
// nextID, streams or peerMaxStreams calls it, under mu.
func (l *Conn) capacityChangedLocked() {
	l.canTake.Store(!l.closed && !l.goAway && l.nextID <= maxStreamID && uint32(len(l.streams)) < l.peerMaxStreams)
}

// Shutdown sends GOAWAY, lets the open streams finish, then closes. It
// returns ctx's error if they had not finished in time, and ErrStalled as
// soon as the connection is stalled (Stalled: its streams cannot finish
// while the peer does not read); the caller closes.
func (l *Conn) Shutdown(ctx context.Context) error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.goAway = true
	l.capacityChangedLocked()
	idle := l.idleChanLocked(0)
	last, why := l.lastPeerID, l.goAwayWhy
	l.mu.Unlock()
	l.writeControl(func(fr *http2.Framer) error { return fr.WriteGoAway(last, http2.ErrCodeNo, why) })
	for {
		var stall <-chan time.Time
		var t *time.Timer
		if l.cfg.StallAfter > 0 {
			left := l.cfg.StallAfter - l.wmu.takenFor(time.Now())
			if left <= 0 {
				return ErrStalled
			}
			t = time.NewTimer(left)
			stall = t.C
		}
		var err error
		select {
		case <-idle:
			l.Close()
		case <-l.readerDone:
		case <-ctx.Done():
			err = ctx.Err()
		case <-stall:
			continue // look again: the write may have drained meanwhile
		}
		if t != nil {
			t.Stop()
		}
		return err
	}
}

// idleChanLocked makes the channel closed once no stream is left (but
// stillOpen streams); the caller holds mu.
func (l *Conn) idleChanLocked(stillOpen int) chan struct{} {
	if l.idle == nil {
		l.idle = make(chan struct{})
		if len(l.streams) == stillOpen {
			close(l.idle)
		}
	}
	return l.idle
}

// GoAwayNow tells the peer this end takes no new stream (and, serving,
// opens none); the connection is closed by whoever ends it next.
func (l *Conn) GoAwayNow() {
	l.mu.Lock()
	l.goAway = true
	l.capacityChangedLocked()
	last, why := l.lastPeerID, l.goAwayWhy
	l.mu.Unlock()
	// Written here rather than queued: the caller closes the connection next.
	l.lockWrite()
	err := l.fr.WriteGoAway(last, http2.ErrCodeNo, why)
	l.unlockWrite()
	if err != nil {
		l.closeWith(fmt.Errorf("write: %w", err))
	}
}

// Sent waits until the peer's TCP has acknowledged every byte this end
// wrote (the socket's send queue is empty), or ctx ends, or the
// connection closes. An owner that closes a connection at once may lose
// the last bytes of its last streams: a socket closed while bytes it
// received are unread is reset, and a reset throws away what the kernel
// had not sent yet. Sockets other than TCP have no such queue: it returns
// at once.
func (l *Conn) Sent(ctx context.Context) {
	if l.tcp == nil {
		return
	}
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		queued := 0
		if err := l.tcp.Control(func(fd uintptr) {
			queued, _ = unix.IoctlGetInt(int(fd), unix.SIOCOUTQ)
		}); err != nil || queued == 0 {
			return
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		case <-l.readerDone:
			return
		}
	}
}

// Close ends the connection and every stream on it.
func (l *Conn) Close() error {
	l.closeWith(ErrClosed)
	return nil
}

// Done is closed once the read loop has ended.
func (l *Conn) Done() <-chan struct{} { return l.readerDone }

func (l *Conn) err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closeErr != nil {
		return l.closeErr
	}
	return ErrClosed
}

func (l *Conn) closeWith(err error) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.closed = true
	l.capacityChangedLocked()
	l.closeErr = fmt.Errorf("%w: %w", ErrClosed, err)
	if errors.Is(err, ErrClosed) {
		l.closeErr = ErrClosed
	}
	streams := make([]*stream, 0, len(l.streams))
	for _, st := range l.streams {
		streams = append(streams, st)
	}
	if l.pingTimer != nil {
		l.pingTimer.Stop()
	}
	l.wakeEverySenderLocked()
	if l.frozen != nil {
		close(l.frozen)
	}
	l.mu.Unlock()
	l.ctlMu.Lock()
	l.ctlClosed = true
	l.ctlQueue = nil
	l.ctlMu.Unlock()
	// A writer stuck on a peer that does not read would hold a TLS
	// connection's Close (its close_notify waits for the writer): release
	// it first.
	l.conn.SetWriteDeadline(time.Now())
	if l.batch != nil && l.wmu.takenFor(time.Now()) > 0 {
		// A write was under way: the socket's buffer is likely full, and
		// TLS's close_notify would wait up to 5 s for a peer that does not
		// read. The socket under TLS goes first, so it fails at once.
		l.batch.Conn.Close()
	}
	l.conn.Close()
	for _, st := range streams {
		st.fail(l.closeErr)
	}
}

// --- keepalive ---

// keepAliveTick runs once nothing was read for KeepAlive: it sends a PING,
// and closes the connection if the answer does not come within
// PingTimeout. It runs on the timer's goroutine, which lives only for the
// call.
func (l *Conn) keepAliveTick() {
	l.checkAndTell(time.Now()) // the credit checks ride on this timer (stall.go)
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	if l.pingOut {
		if time.Now().Before(l.pingDue) {
			// A Probe moved the deadline while this tick waited for mu:
			// the timer fires again then.
			l.mu.Unlock()
			return
		}
		if l.probeAnswered() {
			l.pingOut = false
			l.pingTimer.Reset(l.cfg.KeepAlive)
			l.mu.Unlock()
			return
		}
		l.mu.Unlock()
		l.closeWith(errPingTimeout)
		return
	}
	if idleFor := time.Since(time.Unix(0, l.lastRead.Load())); idleFor < l.cfg.KeepAlive {
		l.pingTimer.Reset(l.cfg.KeepAlive - idleFor)
		l.mu.Unlock()
		return
	}
	l.pingOut = true
	rand.Read(l.pingData[:])
	data := l.pingData
	l.pingDue = time.Now().Add(l.cfg.PingTimeout)
	l.probeSent = time.Time{}
	l.pingTimer.Reset(l.cfg.PingTimeout)
	l.mu.Unlock()
	l.writeControl(func(fr *http2.Framer) error { return fr.WritePing(false, data) })
}

// Serve runs the serving end's read loop until the connection ends.
func (l *Conn) Serve() {
	if l.cfg.KeepAlive > 0 {
		l.mu.Lock()
		l.pingTimer = time.AfterFunc(l.cfg.KeepAlive, l.keepAliveTick)
		l.mu.Unlock()
	}
	for _, f := range l.resumed {
		l.cfg.Spawn(f)
	}
	l.resumed = nil
	l.readLoop()
}
