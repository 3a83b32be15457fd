package h2link

import (
	"context"
	"errors"
	"slices"
	"time"
)

// ErrStalled is what RoundTrip returns when the connection's writes have
// not drained for Config.StallAfter: a write to a peer that does not read
// holds the write lock until the write deadline. The peer saw nothing of
// the stream, so the caller may try elsewhere.
var ErrStalled = errors.New("connection stalled: its writes have not drained")

// takenFor is how long the write lock's owner has had it; 0 while free.
// Owners only write, so a lock taken long is a write that does not drain.
func (w *writeLock) takenFor(now time.Time) time.Duration {
	s := w.since.Load()
	if s == 0 {
		return 0
	}
	return now.Sub(time.Unix(0, s))
}

// lockContext is Lock (an urgent turn: a header block) for a caller with
// a deadline: it stops waiting when ctx ends (its error), or, when stall
// is positive, once one owner has had the lock longer than stall
// (ErrStalled). A waiter that gives up leaves the queue; one that was
// given the lock meanwhile gives it to the next.
func (w *writeLock) lockContext(ctx context.Context, stall time.Duration) error {
	w.mu.Lock()
	if !w.taken {
		w.taken = true
		w.since.Store(time.Now().UnixNano())
		w.mu.Unlock()
		return nil
	}
	if stall > 0 && w.takenFor(time.Now()) > stall {
		w.mu.Unlock()
		return ErrStalled
	}
	t := turnWaiters.Get().(*turnWaiter)
	w.urgent = append(w.urgent, t)
	w.mu.Unlock()
	for {
		var wake <-chan time.Time
		var timer *time.Timer
		if stall > 0 {
			left := stall - w.takenFor(time.Now())
			if left <= 0 {
				return w.giveUp(t, ErrStalled)
			}
			timer = time.NewTimer(left)
			wake = timer.C
		}
		select {
		case <-t.ready:
			if timer != nil {
				timer.Stop()
			}
			turnWaiters.Put(t)
			return nil
		case <-ctx.Done():
			if timer != nil {
				timer.Stop()
			}
			return w.giveUp(t, ctx.Err())
		case <-wake:
			// Look again: the owner may have changed meanwhile.
		}
	}
}

// giveUp takes waiter t out of the queue and returns err; if the lock was
// given to t meanwhile, t gives it to the next.
func (w *writeLock) giveUp(t *turnWaiter, err error) error {
	w.mu.Lock()
	if i := slices.Index(w.urgent, t); i >= 0 {
		w.urgent = slices.Delete(w.urgent, i, i+1)
		w.mu.Unlock()
		turnWaiters.Put(t)
		return err
	}
	w.mu.Unlock()
	<-t.ready
	turnWaiters.Put(t)
	w.Unlock()
	return err
}
