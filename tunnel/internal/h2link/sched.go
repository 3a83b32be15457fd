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
//   - Turns are handed over, never taken: a writer that finds the lock held
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
//   - The kernel's queue of unsent bytes is kept to one turn
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
	held   bool          // under mu
	urgent []*turnWaiter // under mu: control frames, header blocks, small writes, oldest first
	bulk   []*turnWaiter // under mu: bulk turns, oldest first
	// since is when the holder got the lock (unix nanoseconds), 0 while it
	// is free; written under mu, read by anyone (heldFor, wlock.go).
	since atomic.Int64
}

// turnWaiter is one writer waiting: the lock is handed to it on ready.
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
	if !w.held {
		w.held = true
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
	<-t.ready // the holder handed the lock over
	turnWaiters.Put(t)
}

// Unlock hands the lock to the next writer: the oldest urgent one, else
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
		w.held = false
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
// bulk write leaves smallWrite of it to small ones, so that they need not
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

// pace learns the link's speed from a turn that wrote n bytes in d, and
// sets the next turn's size (and the socket's unsent bound) to what the
// link sends in about turnTime. A turn that took long shrinks the next;
// one that went at once doubles it. Sizes are powers of two, so the
// socket option changes only when the link's speed does. The caller holds
// wmu.
func (l *Conn) paceWLocked(n int64, d time.Duration) {
	cur := l.turn.Load()
	next := cur
	switch {
	case d > turnTime && n >= minTurn:
		// The link took d for n: it sends n*turnTime/d in turnTime.
		want := int64(float64(n) * float64(turnTime) / float64(d))
		for next > minTurn && next > want {
			next /= 2
		}
	case d < turnTime/2 && n >= cur/2:
		next = min(cur*2, maxTurn)
	}
	if next != cur {
		l.turn.Store(next)
		l.setUnsentBound(unsentBound(next))
	}
}

// unsentBound is the kernel's share of a link whose turns are turn bytes:
// one turn; four on a link fast enough for the largest turn, where that
// is still under a few milliseconds and a writer need not wait for the
// kernel at every turn.
func unsentBound(turn int64) int64 {
	if turn >= maxTurn {
		return 4 * maxTurn
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
