package h2link

import (
	"context"
	"errors"
	"sync/atomic"
	"time"
)

// ErrStalled is what RoundTrip returns when the connection's writes have
// not drained for Config.StallAfter: a write to a peer that does not read
// holds the write lock until the write deadline. The peer saw nothing of
// the stream, so the caller may try elsewhere.
var ErrStalled = errors.New("connection stalled: its writes have not drained")

// writeLock is the connection's write lock (Conn.wmu): a mutex that a
// caller with a deadline can stop waiting for, and that says how long its
// holder has had it. Holders write to the connection and nothing else, so
// a lock held long is a write that does not drain.
type writeLock struct {
	ch    chan struct{} // one token while held
	since atomic.Int64  // unix nanoseconds its holder took it; 0 while free
}

func newWriteLock() writeLock { return writeLock{ch: make(chan struct{}, 1)} }

// Lock waits for the lock.
func (w *writeLock) Lock() {
	w.ch <- struct{}{}
	w.since.Store(time.Now().UnixNano())
}

// Unlock releases the lock, which the caller holds.
func (w *writeLock) Unlock() {
	w.since.Store(0)
	<-w.ch
}

// heldFor is how long the current holder has had the lock; 0 while free.
func (w *writeLock) heldFor(now time.Time) time.Duration {
	s := w.since.Load()
	if s == 0 {
		return 0
	}
	return now.Sub(time.Unix(0, s))
}

// lockContext waits for the lock until ctx ends (its error), or, when
// stall is positive, until one holder has had it longer than stall
// (ErrStalled).
func (w *writeLock) lockContext(ctx context.Context, stall time.Duration) error {
	for {
		select {
		case w.ch <- struct{}{}:
			w.since.Store(time.Now().UnixNano())
			return nil
		default:
		}
		var wake <-chan time.Time
		var t *time.Timer
		if stall > 0 {
			left := stall - w.heldFor(time.Now())
			if left <= 0 {
				return ErrStalled
			}
			t = time.NewTimer(left)
			wake = t.C
		}
		select {
		case w.ch <- struct{}{}:
			w.since.Store(time.Now().UnixNano())
			if t != nil {
				t.Stop()
			}
			return nil
		case <-ctx.Done():
			if t != nil {
				t.Stop()
			}
			return ctx.Err()
		case <-wake:
			// Look again: the holder may have changed meanwhile.
		}
	}
}
