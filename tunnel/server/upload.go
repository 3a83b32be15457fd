package server

import (
	"bufio"
	"errors"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/spinifex/konnectivity/tunnel/wire"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// upload is the client-to-agent direction of a tunnel, and part of it
// (tunnel.up). The link reads it as the CONNECT request body, but only
// after the agent has answered: until then a watcher merely peeks, so a
// client that gives up during a pending dial cancels it, and a dial
// retried on another agent has lost no byte.
type upload struct {
	// Set by init, or before start by the goroutine serving the tunnel;
	// read-only afterwards.
	br            *bufio.Reader
	unblock       func() // releases a Read blocked on the source
	established   chan struct{}
	isEstablished atomic.Bool
	peeked        chan struct{} // the watcher's Peek returned: data, EOF or error
	clientGone    chan struct{} // closed by clientLeft: the client went away during the dial
	done          chan struct{} // the upload ended: EOF, error, or the link let go
	doneOnce      sync.Once
	counters      []*atomic.Int64 // bytes read are added to each
	raw           syscall.RawConn // the client's socket, when it is a plain one: see SendTo
	parks         bool            // otherwise, if set: the source says errQuiet rather than wait (see sendParking)
	callerSends   bool            // the frontend sends the body itself (see sentByCaller)
	bufSize       int             // owned by whoever sends: sendParking's next buffer
	// packets counts each chunk sent on as one DATA Packet (see packets.go)
	// in each counter that is set; set before start, read after it.
	packets wire.PacketCounter
	closes  wire.PacketCounter // the client's clean end of sending (EOF)
	sender  wire.PacketWriter  // SendTo's counting writer, stored here so it costs no allocation
	act     *wire.Activity     // the tunnel's; reads from the client stamp it

	// goneMu (a leaf lock) guards onGone: the dial attempt's cancel while
	// it waits for its answer, which clientLeft runs (see cancelOnGone).
	// A func and not a context, so that a tunnel holds nothing for it
	// once the dial is answered.
	goneMu sync.Mutex
	onGone func()

	// A stop for a restart's move (handover.go). stopping is set by it;
	// sent and stopped are written by the goroutine sending the upload
	// before done is closed, and read after.
	stopping atomic.Bool // the upload's deadline is the move's, not the client's end
	stopped  bool        // the upload stopped for it, every byte read sent
	sent     int64       // bytes sent to the agent on this tunnel
}

var errAbandoned = errors.New("dial attempt abandoned")

// errQuiet is what a source that parks (upload.parks) returns where a Read
// would wait, having asked to be woken once it has bytes: its reader lets
// its goroutine go meanwhile. No byte is lost: the source keeps what it
// holds for the next Read.
var errQuiet = errors.New("source quiet: its reader is woken when bytes come")

// init starts the watcher through spawn, which must run it as an owned
// goroutine; it ends when data arrives or the source is closed. unblock
// must make a Read blocked on br's source return.
func (u *upload) init(br *bufio.Reader, unblock func(), act *wire.Activity, spawn func(func())) {
	u.prepare(br, unblock, act)
	spawn(func() {
		_, err := br.Peek(1)
		u.peekedWith(err)
	})
}

// prepare is init without the watcher: a source that parks has its
// watcher's Peek made by peekParking.
func (u *upload) prepare(br *bufio.Reader, unblock func(), act *wire.Activity) {
	u.br, u.unblock, u.act = br, unblock, act
	u.established, u.peeked, u.done = make(chan struct{}), make(chan struct{}), make(chan struct{})
	u.clientGone = make(chan struct{})
	u.bufSize = wire.SmallBufSize
}

// peekedWith records the return of the watcher's Peek: a source that
// ended before the dial was answered cancels it.
func (u *upload) peekedWith(err error) {
	close(u.peeked)
	if err != nil && !u.isEstablished.Load() {
		u.clientLeft()
	}
}

// clientLeft tells the dial that the client went away: clientGone closes
// and the attempt waiting for its answer is cancelled. Once, from the
// watcher.
func (u *upload) clientLeft() {
	u.goneMu.Lock()
	close(u.clientGone)
	cancel := u.onGone
	u.onGone = nil
	u.goneMu.Unlock()
	if cancel != nil {
		cancel()
	}
}

// cancelOnGone has clientLeft run cancel while a dial attempt waits for
// its answer, or runs it at once if the client has gone already; the
// attempt calls it with nil once it has its answer.
func (u *upload) cancelOnGone(cancel func()) {
	u.goneMu.Lock()
	gone := false
	select {
	case <-u.clientGone:
		gone = true
	default:
		u.onGone = cancel
	}
	u.goneMu.Unlock()
	if gone && cancel != nil {
		cancel()
	}
}

// peekParking is the watcher's Peek for a source that parks, made by the
// goroutine that reads it: false while the source is quiet (it wakes that
// goroutine's owner when bytes come), true once the Peek has returned.
func (u *upload) peekParking() bool {
	select {
	case <-u.peeked:
		return true
	default:
	}
	_, err := u.br.Peek(1)
	if err == errQuiet {
		return false
	}
	u.peekedWith(err)
	return true
}

// start lets the link read: the client has been told 200.
func (u *upload) start() {
	u.isEstablished.Store(true)
	close(u.established)
}

func (u *upload) isDone() bool {
	select {
	case <-u.done:
		return true
	default:
		return false
	}
}

func (u *upload) finish() { u.doneOnce.Do(func() { close(u.done) }) }

// attempt returns the request body for one dial attempt.
func (u *upload) attempt() *uploadBody {
	return &uploadBody{u: u, abandoned: make(chan struct{})}
}

type uploadBody struct {
	u         *upload
	abandoned chan struct{}
	once      sync.Once
}

// CallerSends tells the link that the frontend sends this body itself
// (through (*h2link.Body).SendUpload) once it has the answer.
func (b *uploadBody) CallerSends() bool { return b.u.callerSends }

// abandon ends this attempt's body; it must happen before another attempt
// can be established, so that only one reader ever touches the connection.
func (b *uploadBody) abandon() { b.once.Do(func() { close(b.abandoned) }) }

func (b *uploadBody) isAbandoned() bool {
	select {
	case <-b.abandoned:
		return true
	default:
		return false
	}
}

// ready waits until this attempt may read: the client was told 200 and the
// watcher's Peek returned.
func (b *uploadBody) ready() error {
	select {
	case <-b.u.established:
	case <-b.abandoned:
		return errAbandoned
	}
	if b.isAbandoned() {
		return errAbandoned
	}
	select {
	case <-b.u.peeked:
	case <-b.abandoned:
		return errAbandoned
	}
	return nil
}

func (b *uploadBody) Read(p []byte) (int, error) {
	if err := b.ready(); err != nil {
		return 0, err
	}
	n, err := b.u.br.Read(p)
	if err == errQuiet {
		return 0, err // nothing read: the source wakes the sender (sendParking)
	}
	for _, c := range b.u.counters {
		c.Add(int64(n))
	}
	b.u.sent += int64(n)
	if err != nil && b.u.stopping.Load() && errors.Is(err, h2link.ErrReadStopped) {
		b.u.stopped = true // every byte read was returned to the link before this call
		err = h2link.ErrUploadStopped
	}
	if n > 0 {
		b.u.act.Up()
		b.u.packets.Inc()
	}
	if err == io.EOF {
		b.u.closes.Inc()
	}
	if err != nil {
		b.u.finish()
	}
	return n, err
}

// Close is called by the link when it is done with the body:
// after EOF, or when the stream ended early. In the second case a Read may
// be blocked on the connection; a past deadline releases it.
func (b *uploadBody) Close() error {
	if b.isAbandoned() || !b.u.isEstablished.Load() {
		b.abandon()
		return nil
	}
	b.abandon()
	b.u.unblock()
	b.u.finish()
	return nil
}

// sendBuffered sends to w what the head's reader still holds, the first
// part of SendTo's upload from a plain socket, without a buffer of the
// caller's; the rest goes straight from the socket with a buffer taken
// only while bytes are there (wire.CopyFromSocket), so a quiet tunnel
// holds neither.
func (b *uploadBody) sendBuffered(w io.Writer) error {
	if err := b.ready(); err != nil {
		return err
	}
	u := b.u
	if n := u.br.Buffered(); n > 0 {
		p, _ := u.br.Peek(n)
		u.act.Up()
		_, err := w.Write(p)
		u.br.Discard(n)
		u.count(n)
		u.sent += int64(n)
		u.packets.Inc()
		if err != nil {
			u.finish()
			return err
		}
	}
	// Drained, and the watcher's Peek has returned (ready): nothing else
	// holds the reader, so it goes back for the next dial.
	u.br.Reset(nil)
	headReaders.Put(u.br)
	u.br = nil
	return nil
}

// SendTo sends the upload to w until the client's end, for the link: from
// the socket without a buffer while it is quiet when the client is a
// plain socket (sendBuffered, then wire.CopyFromSocket straight from here:
// see "Parked stacks" in doc.go), else through wire.CopyStream. It returns
// nil at the client's clean end.
func (b *uploadBody) SendTo(w io.Writer) error {
	if b.u.raw == nil && b.u.parks {
		return b.sendParking(w)
	}
	if b.u.raw == nil {
		_, err := wire.CopyStream(w, b, nil)
		return err
	}
	if err := b.sendBuffered(w); err != nil {
		return err
	}
	b.u.sender.W, b.u.sender.C, b.u.sender.Up = w, b.u.packets, b.u.act
	n, err := wire.CopyFromSocket(&b.u.sender, b.u.raw, nil)
	b.u.count(int(n))
	b.u.sent += n
	if err == nil {
		b.u.closes.Inc()
	}
	if err != nil && b.u.stopping.Load() && errors.Is(err, os.ErrDeadlineExceeded) {
		b.u.stopped = true
		err = h2link.ErrUploadStopped
	}
	b.u.finish()
	return err
}

// sendParking is SendTo for a source that parks (the gRPC door's call):
// it borrows a buffer for each read (a small one, a large one while reads
// fill it), and once the source is quiet it returns ErrUploadParked, so a
// quiet tunnel holds neither a buffer nor a goroutine; the tunnel's
// carrier sends on when the source wakes it. It returns nil at the
// client's clean end. Called by one goroutine at a time, after the
// watcher's Peek returned.
func (b *uploadBody) sendParking(w io.Writer) error {
	if err := b.ready(); err != nil {
		return err
	}
	for {
		bp := wire.GetBuf(b.u.bufSize)
		n, rerr := b.Read(*bp)
		if rerr == errQuiet {
			wire.PutBuf(bp)
			return h2link.ErrUploadParked
		}
		var werr error
		if n > 0 {
			_, werr = w.Write((*bp)[:n])
		}
		switch {
		case n == len(*bp):
			b.u.bufSize = wire.LargeBufSize
		case n < wire.SmallBufSize:
			b.u.bufSize = wire.SmallBufSize
		}
		wire.PutBuf(bp)
		if werr != nil {
			return werr
		}
		if rerr != nil {
			if errors.Is(rerr, io.EOF) {
				return nil
			}
			return rerr
		}
	}
}

func (u *upload) count(n int) {
	for _, c := range u.counters {
		c.Add(int64(n))
	}
}
