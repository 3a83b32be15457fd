package h2link

import (
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The link's writer is whoever holds the write lock, and the lock decides
// who writes next: that order is the order frames leave in, so it is what
// a small write waits behind on a slow link.
//
//   - Turns are given, never taken: a writer that finds the lock taken
//     waits in a queue and is given the lock by the one before it, so a
//     writer cannot be overtaken by one that came later.
//   - Two queues. A control frame, a header block, or a DATA write of at
//     most smallWrite bytes (a keystroke, a webhook call, a PING ack) waits
//     in the first and goes next; the bulk streams' turns wait in the
//     second and go in the order they asked. A bulk writer asks again for
//     each turn, so bulk streams take turns.
//   - A bulk turn writes at most Conn.turn bytes: what the link sends in
//     about turnTime, measured from how long turns take to write (pace).
//     On a fast link a turn is two frames, one system call; on a slow one
//     it is one small frame, so the turn in progress is short too.
//   - The kernel's queue of unsent bytes is bounded to one turn
//     (TCP_NOTSENT_LOWAT on the socket), so bytes leave in the order the
//     lock gave, not behind what a socket buffer already holds.
//
// Waiting costs the waiter nothing beyond what it already holds: the
// goroutine that has the bytes waits, with a pooled one-slot channel. An
// idle link holds no queue.

// smallWrite is the largest DATA write that goes ahead of bulk turns.
const smallWrite = 16 << 10

// Bounds of a bulk turn, and the time one should take to write.
const (
	minTurn  = 8 << 10
	maxTurn  = 2 * MaxFrameSize
	turnTime = 2 * time.Millisecond
)

// writeLock is Conn.wmu: a lock whose waiters are served in order, small
// writes first. Its own mu is a leaf.
type writeLock struct {
	mu     sync.Mutex
	taken  bool          // under mu
	urgent []*turnWaiter // under mu: control frames, header blocks, small writes, oldest first
	bulk   []*turnWaiter // under mu: bulk turns, oldest first
	// since is when the owner got the lock (unix nanoseconds), 0 while it
	// is free; written under mu, read by anyone (takenFor, wlock.go).
	since atomic.Int64
}

// turnWaiter is one writer waiting: the lock is given to it on ready.
type turnWaiter struct{ ready chan struct{} }

// turnWaiters is immutable after init (a sync.Pool is safe for concurrent use).
var turnWaiters = sync.Pool{New: func() any { return &turnWaiter{ready: make(chan struct{}, 1)} }}

// Lock takes the lock for a control frame or a header block: ahead of
// bulk turns.
func (w *writeLock) Lock() { w.lock(false) }

// lock takes the lock, after the urgent writers waiting and, for a bulk
// turn, after the bulk turns waiting too.
func (w *writeLock) lock(bulk bool) {
	w.mu.Lock()
	if !w.taken {
		w.taken = true
		w.since.Store(time.Now().UnixNano())
		w.mu.Unlock()
		return
	}
	t := turnWaiters.Get().(*turnWaiter)
	if bulk {
		w.bulk = append(w.bulk, t)
	} else {
		w.urgent = append(w.urgent, t)
	}
	w.mu.Unlock()
	<-t.ready // the owner gave it the lock
	turnWaiters.Put(t)
}

// Unlock gives the lock to the next writer: the oldest urgent one, else
// the oldest bulk turn; or frees it.
func (w *writeLock) Unlock() {
	w.mu.Lock()
	var next *turnWaiter
	switch {
	case len(w.urgent) > 0:
		next, w.urgent = pop(w.urgent)
	case len(w.bulk) > 0:
		next, w.bulk = pop(w.bulk)
	default:
		w.taken = false
	}
	if next != nil {
		w.since.Store(time.Now().UnixNano())
	} else {
		w.since.Store(0)
	}
	w.mu.Unlock()
	if next != nil {
		next.ready <- struct{}{}
	}
}

// pop takes the oldest waiter off q; an emptied queue lets its array go.
func pop(q []*turnWaiter) (*turnWaiter, []*turnWaiter) {
	t := q[0]
	q[0] = nil
	if len(q) == 1 {
		return t, nil
	}
	return t, q[1:]
}

// connAvailLocked is the connection send window a write may take: a
// bulk write spares smallWrite of it for small ones, so that they need not
// wait for credit behind bulk streams, when the peer's window is large
// enough to spare it. The caller holds mu.
func (l *Conn) connAvailLocked(bulk bool) int64 {
	if bulk && l.sendPeak >= 4*smallWrite {
		return l.sendWindow.avail() - smallWrite
	}
	return l.sendWindow.avail()
}

// turnBytes is the most a bulk turn writes now.
func (l *Conn) turnBytes() int64 { return l.turn.Load() }

// pace learns the link's speed from how long bulk turns take to write
// (their system calls, under a Batcher),
// and sets the next turns' size (and the socket's unsent bound) to what
// the link sends in about turnTime. Turns are timed together over a
// pacePeriod or paceTurns of them, whichever comes first. A period that
// allows larger turns takes them at once; smaller turns need paceSlow
// slow periods in a row, so that a pause of a busy machine in one write
// does not shrink the turns of a fast link, while a slow link shows in
// its first few turns. Sizes are powers of two, so the socket option
// changes only when the link's speed does. The caller holds wmu.
func (l *Conn) paceWLocked(n int64, d time.Duration) {
	p := &l.pace
	p.bytes += n
	p.time += d
	if p.turns++; p.time < pacePeriod && p.turns < paceTurns {
		return
	}
	rate := float64(p.bytes) / max(p.time, time.Microsecond).Seconds()
	p.bytes, p.time, p.turns = 0, 0, 0
	fits := int64(maxTurn)
	for fits > minTurn && float64(fits) > rate*turnTime.Seconds() {
		fits /= 2
	}
	cur := l.turn.Load()
	next := cur
	switch {
	case fits >= cur:
		p.slow, p.slowFits = 0, 0
		next = fits
	case p.slow+1 < paceSlow:
		p.slow++
		p.slowFits = max(p.slowFits, fits)
		return
	default:
		next = max(p.slowFits, fits)
		p.slow, p.slowFits = 0, 0
	}
	if next != cur {
		l.turn.Store(next)
		l.setUnsentBound(unsentBound(next))
	}
}

// pacing is the timing of a link's bulk turns; under Conn.wmu.
type pacing struct {
	bytes    int64         // written by the turns of this period
	time     time.Duration // that they took
	turns    int
	slow     int   // periods in a row that wanted smaller turns
	slowFits int64 // the largest turn they wanted
}

// fastUnsent is the unsent bound of a link fast enough for the largest
// turn: eight turns, a few milliseconds at a gigabit, and what keeps a
// loopback writer from waking for every few turns.
const fastUnsent = 8 * maxTurn

// A pacing period.
const (
	pacePeriod = 20 * time.Millisecond
	paceTurns  = 16
	paceSlow   = 3
)

// unsentBound is the kernel's share of a link whose turns are turn bytes:
// one turn; fastUnsent on a link fast enough for the largest turn.
func unsentBound(turn int64) int64 {
	if turn >= maxTurn {
		return fastUnsent
	}
	return turn
}

// setUnsentBound keeps the kernel's queue of bytes not yet sent on the
// link's TCP socket to about n (TCP_NOTSENT_LOWAT): a write waits beyond
// it, and what waits is ordered by the write lock. Other sockets (Unix,
// pipes) have no such queue of their own worth bounding: it does nothing.
func (l *Conn) setUnsentBound(n int64) {
	if l.tcp == nil {
		return
	}
	l.tcp.Control(func(fd uintptr) {
		unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT, int(n))
	})
}

// tcpSocket finds the TCP socket under c: through a Batcher, TLS (a
// NetConn method) and wrappers that say what they wrap (NetConn).
func tcpSocket(c net.Conn, b *Batcher) syscall.RawConn {
	if b != nil {
		c = b.Conn
	}
	for range 8 {
		switch t := c.(type) {
		case *net.TCPConn:
			rc, err := t.SyscallConn()
			if err != nil {
				return nil
			}
			return rc
		case *net.UnixConn:
			return nil
		case interface{ NetConn() net.Conn }:
			c = t.NetConn()
		default:
			return nil
		}
	}
	return nil
}
