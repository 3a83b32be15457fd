package kubeapi

import (
	"context"
	"math/rand/v2"
	"time"
)

// Pace waits until the call last records is gap ago, then records a new
// one; false means ctx ended first. A client keeps each kind of call
// (list, watch) gap apart, so an apiserver that ends every watch at once,
// or answers every watch with 410, is not called in a tight loop.
func Pace(ctx context.Context, last *time.Time, gap time.Duration) bool {
	if wait := gap - time.Since(*last); wait > 0 && !Sleep(ctx, wait) {
		return false
	}
	*last = time.Now()
	return true
}

// Sleep waits d or until ctx ends; false means ctx ended.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Jitter returns d plus up to factor×d, so a fleet of clients does not
// call the apiserver in step.
func Jitter(d time.Duration, factor float64) time.Duration {
	return d + time.Duration(rand.Float64()*factor*float64(d))
}
