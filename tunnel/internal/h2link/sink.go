package h2link

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/net/http2"
	"golang.org/x/sys/unix"
)

// A stream's received bytes usually go to a plain socket: the client's Unix
// socket on the server, the destination's TCP socket on the agent. Rather
// than keep a goroutine per tunnel parked until they come, the link's read
// loop writes them itself while the socket takes them without waiting, and
// only when it would wait does a writer goroutine take over; it ends once
// it has caught up. A quiet tunnel then costs one goroutine per process
// (the one reading its socket) instead of two, and a byte passing through
// wakes one goroutine fewer in each process.
//
// The read loop never blocks: its write is one non-blocking system call,
// and whatever the socket did not take is queued for the writer.

// Delivery is the progress of a stream's bytes into a socket.
type Delivery struct {
	done    chan struct{} // closed when delivery ended
	written atomic.Int64  // bytes written so far; any goroutine
	err     error         // written once, before done is closed: nil after a clean END_STREAM
	// mark is the one waiter of WaitWritten, if any: whoever adds bytes that
	// take written to its count closes its channel.
	mark atomic.Pointer[deliveryMark]
}

// deliveryMark is a count of written bytes someone waits for.
type deliveryMark struct {
	n    int64
	ch   chan struct{}
	once sync.Once
}

func (m *deliveryMark) reach() { m.once.Do(func() { close(m.ch) }) }

// Done is closed once everything was delivered, or delivery failed.
func (d *Delivery) Done() <-chan struct{} { return d.done }

// Result is what was written and why delivery ended; valid after Done.
func (d *Delivery) Result() (int64, error) { return d.written.Load(), d.err }

// Written is the count of bytes written so far.
func (d *Delivery) Written() int64 { return d.written.Load() }

// NewDelivery is a delivery that its caller carries out itself: it adds
// what it wrote with Add, and ends it with Complete.
func NewDelivery() *Delivery { return &Delivery{done: make(chan struct{})} }

// Add counts n more bytes written, for a delivery made with NewDelivery.
func (d *Delivery) Add(n int64) { d.add(n) }

// Complete ends a delivery made with NewDelivery; once only.
func (d *Delivery) Complete(err error) { d.complete(err) }

// add counts n more bytes written and wakes the waiter of Reached once
// its count is met: one atomic load more than the count itself.
func (d *Delivery) add(n int64) {
	w := d.written.Add(n)
	if m := d.mark.Load(); m != nil && w >= m.n {
		m.reach()
	}
}

// reached returns a channel closed once n bytes in all were written
// (at once if they were). One waiter at a time: a later call replaces an
// earlier one's count.
func (d *Delivery) reached(n int64) <-chan struct{} {
	m := &deliveryMark{n: n, ch: make(chan struct{})}
	d.mark.Store(m)
	if d.written.Load() >= n {
		m.reach()
	}
	return m.ch
}

// WaitWritten waits until exactly n bytes in all were written. It fails
// when more were, when the delivery ends short of n, or when ctx ends
// first. One waiter at a time.
func (d *Delivery) WaitWritten(ctx context.Context, n int64) error {
	select {
	case <-d.reached(n):
	case <-d.done:
	case <-ctx.Done():
	}
	switch w := d.written.Load(); {
	case w == n:
		return nil
	case w > n:
		return fmt.Errorf("%d bytes written, more than the %d expected", w, n)
	case ctx.Err() != nil:
		return fmt.Errorf("%d of %d bytes written: %w", w, n, ctx.Err())
	default:
		return fmt.Errorf("delivery ended after %d of %d bytes", w, n)
	}
}

func (d *Delivery) complete(err error) {
	d.err = err
	close(d.done)
}

// RawSocket returns the raw connection of a plain TCP or Unix socket; nil
// for anything else (TLS, pipes, HTTP bodies).
func RawSocket(r io.Reader) syscall.RawConn {
	var sc syscall.Conn
	switch c := r.(type) {
	case *net.TCPConn:
		sc = c
	case *net.UnixConn:
		sc = c
	default:
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// socketSink is a delivery in progress on a plain socket.
type socketSink struct {
	// Immutable once set in stream.sink (under rmu).
	conn  net.Conn
	raw   syscall.RawConn
	after func(error) error // runs once at the end, outside every lock; must not block
	d     *Delivery

	// Under the stream's rmu.
	writer bool // a writer goroutine drains the queue: the read loop only queues
	ended  bool // the end was reported (or is being)
}

// OnWrite has f told of each write of the stream's received bytes that
// DeliverTo or WriteTo makes (n > 0 bytes, one or more DATA payloads in
// one system call), in order, as the write returns: a count of writes, or
// a stamp of the stream's last activity. Set it before either starts. f
// runs under the stream's lock, from the read loop or a writer, so it
// must be a few atomic operations and never block.
func (b *Body) OnWrite(f func(n int)) {
	b.st.rmu.Lock()
	b.st.onWrite = f
	b.st.rmu.Unlock()
}

// DeliverTo sends everything the peer sends on the stream to conn. At the
// stream's clean end after gets nil (it passes the half-close on); when
// the stream was reset, the link failed or conn refused a write, it gets
// that error. Its result is the delivery's. after runs from the link's read
// loop or a writer goroutine, so it must not block. For a connection that
// is not a plain socket (TLS) an owned goroutine copies instead.
func (b *Body) DeliverTo(conn net.Conn, after func(error) error) *Delivery {
	d := &Delivery{done: make(chan struct{})}
	st := b.st
	raw := RawSocket(conn)
	if raw == nil {
		st.l.cfg.Spawn(func() {
			n, err := b.WriteTo(conn)
			d.add(n)
			d.complete(after(err))
		})
		return d
	}
	st.rmu.Lock()
	st.sink = &socketSink{conn: conn, raw: raw, after: after, d: d}
	next := st.sinkStepRLocked()
	st.rmu.Unlock()
	next()
	return d
}

// Sink returns the socket and the delivery of stream id's received bytes,
// when DeliverTo is carrying them (nil otherwise): how a control request
// that names a stream finds where its bytes go.
func (l *Conn) Sink(id uint32) (net.Conn, *Delivery) {
	l.mu.Lock()
	st := l.streams[id]
	l.mu.Unlock()
	if st == nil {
		return nil, nil
	}
	st.rmu.Lock()
	defer st.rmu.Unlock()
	if st.sink == nil {
		return nil, nil
	}
	return st.sink.conn, st.sink.d
}

// sinkStepRLocked moves a stream's socket delivery on after its state
// changed (bytes queued, END_STREAM, reset, reader gone): a writer takes
// over queued bytes, or the end is reported. It returns what must run once
// rmu is released.
func (st *stream) sinkStepRLocked() func() {
	s := st.sink
	if s == nil || s.writer || s.ended {
		return noop
	}
	switch {
	case st.readerGone:
		s.ended = true
		return func() { st.endSink(errors.New("delivery stopped: the body was closed")) }
	case len(st.queue) > 0:
		s.writer = true
		return func() { st.l.cfg.Spawn(st.drainSink) }
	case st.recvErr != nil:
		s.ended = true
		err := st.recvErr
		return func() { st.endSink(err) }
	case st.eof:
		s.ended = true
		return func() { st.endSink(nil) }
	}
	return noop
}

// endSink reports the end of delivery: after runs, then Done is closed.
func (st *stream) endSink(err error) {
	s := st.sink
	s.d.complete(s.after(err))
}

// writeToSinkRLocked is the read loop's attempt to give data straight to the
// socket: one non-blocking write, and only while nothing is queued and no
// writer is busy (bytes must stay in order). It returns how much the
// socket took; a failed socket ends the delivery.
func (st *stream) writeToSinkRLocked(data []byte) (n int, failed error) {
	s := st.sink
	if s == nil || s.writer || s.ended || len(st.queue) > 0 {
		return 0, nil
	}
	var werr error
	err := s.raw.Write(func(fd uintptr) bool {
		for {
			n, werr = unix.Write(int(fd), data)
			if werr != unix.EINTR {
				break
			}
		}
		return true // never wait here: the read loop serves every stream
	})
	if n < 0 {
		n = 0
	}
	switch {
	case err != nil:
		return 0, err
	case werr == unix.EAGAIN:
		return 0, nil
	case werr != nil:
		return 0, os.NewSyscallError("write", werr)
	}
	s.d.add(int64(n))
	if n > 0 && st.onWrite != nil {
		st.onWrite(n)
	}
	return n, nil
}

// drainSink is the writer goroutine: it writes what is queued, waiting for
// the socket as long as it must, and ends once the queue is empty.
func (st *stream) drainSink() {
	s := st.sink
	for {
		st.rmu.Lock()
		if len(st.queue) == 0 || st.readerGone {
			s.writer = false
			next := st.sinkStepRLocked()
			st.rmu.Unlock()
			next()
			return
		}
		chunks, head := st.queue, st.head
		st.queue, st.head = nil, 0
		st.rmu.Unlock()

		n, taken, err := writeChunks(s.conn, chunks, head)
		s.d.add(n)
		st.rmu.Lock()
		if n > 0 && st.onWrite != nil {
			st.onWrite(int(n))
		}
		st.unacked += int64(taken) // off the queue, written or not: credit it all
		st.queuedRLocked(-int64(taken))
		st.refillRLocked()
		if err != nil {
			st.rmu.Unlock()
			st.sinkFailed(err)
			return
		}
		st.rmu.Unlock()
	}
}

// writeChunks writes queued chunks (the first from head on) in one writev
// and returns them to their pool. taken is how many bytes left the queue.
func writeChunks(w io.Writer, chunks []*[]byte, head int) (written int64, taken int, err error) {
	taken = -head
	bufs := make(net.Buffers, 0, len(chunks))
	for i, c := range chunks {
		taken += len(*c)
		if i == 0 {
			bufs = append(bufs, (*c)[head:])
		} else {
			bufs = append(bufs, *c)
		}
	}
	written, err = bufs.WriteTo(w)
	for _, c := range chunks {
		putChunk(c)
	}
	return written, taken, err
}

// sinkFailed ends a delivery whose socket refused a write. What still
// comes is dropped and credited; the server's end also resets the stream,
// so the agent stops sending (the agent's end closes its destination in
// after, and its handler then resets).
func (st *stream) sinkFailed(err error) {
	st.rmu.Lock()
	s := st.sink
	s.writer = false
	already := s.ended
	s.ended = true
	st.readerGone = true
	st.dropQueueRLocked()
	st.recvCond.Broadcast()
	st.rmu.Unlock()
	if already {
		return
	}
	err = fmt.Errorf("write to %s: %w", s.conn.RemoteAddr(), err)
	if !st.l.serving {
		st.reset(http2.ErrCodeCancel, fmt.Errorf("%w: %v", ErrStreamReset, err))
	}
	st.endSink(err)
}
