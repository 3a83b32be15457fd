package daemon

import (
	"context"
	"io"
	"log/slog"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

func TestShouldTrim(t *testing.T) {
	const mib = 1 << 20
	quiet := heapSample{gcCycles: 4} // the previous sample: no collection since
	cases := []struct {
		name  string
		now   heapSample
		since trimState
		want  bool
	}{
		{"fresh collection, heap near its goal", heapSample{heap: 40 * mib, live: 20 * mib, gcCycles: 5}, trimState{heap: 4 * mib}, false},
		{"fresh collection, far more held than the goal", heapSample{heap: 120 * mib, live: 10 * mib, gcCycles: 5}, trimState{heap: 4 * mib}, true},
		{"no collection, grown since the last trim", heapSample{heap: 150 * mib, live: 140 * mib, gcCycles: 4}, trimState{heap: 5 * mib}, true},
		{"no collection, no growth since the last trim", heapSample{heap: 40 * mib, live: 35 * mib, gcCycles: 4}, trimState{heap: 38 * mib}, false},
		{"no collection, a large live heap grown by a tenth", heapSample{heap: 456 * mib, live: 416 * mib, gcCycles: 4, goroutines: 160000}, trimState{heap: 416 * mib, fewestGoroutines: 160000, mostGoroutines: 160000}, false},
		{"no collection, a large live heap grown by a half", heapSample{heap: 624 * mib, live: 416 * mib, gcCycles: 4, goroutines: 160000}, trimState{heap: 416 * mib, fewestGoroutines: 160000, mostGoroutines: 160000}, true},
		{"fresh collection, a large live heap near its goal", heapSample{heap: 900 * mib, live: 416 * mib, gcCycles: 5, goroutines: 160000}, trimState{heap: 416 * mib, fewestGoroutines: 160000, mostGoroutines: 160000}, false},
		{"small idle daemon", heapSample{heap: 6 * mib, live: 2 * mib, gcCycles: 4, goroutines: 20}, trimState{heap: 4 * mib, fewestGoroutines: 18, mostGoroutines: 22}, false},
		{"quiet, 1000 tunnels opened since the last trim", heapSample{heap: 30 * mib, live: 20 * mib, gcCycles: 4, goroutines: 1020}, trimState{heap: 25 * mib, fewestGoroutines: 20, mostGoroutines: 1020}, true},
		{"quiet, a few tunnels opened since the last trim", heapSample{heap: 8 * mib, live: 4 * mib, gcCycles: 4, goroutines: 120}, trimState{heap: 6 * mib, fewestGoroutines: 20, mostGoroutines: 120}, false},
		{"1000 tunnels opened, a collection ran: not quiet yet", heapSample{heap: 30 * mib, live: 20 * mib, gcCycles: 5, goroutines: 1020}, trimState{heap: 25 * mib, fewestGoroutines: 20, mostGoroutines: 1020}, false},
		{"quiet, 10,000 tunnels closed since the last trim", heapSample{heap: 100 * mib, live: 90 * mib, gcCycles: 4, goroutines: 20}, trimState{heap: 100 * mib, fewestGoroutines: 20, mostGoroutines: 10020}, true},
	}
	for _, c := range cases {
		last := quiet
		last.goroutines = c.now.goroutines // as many goroutines as the sample before
		if got := shouldTrim(c.now, last, c.since); got != c.want {
			t.Errorf("%s: shouldTrim = %v, want %v", c.name, got, c.want)
		}
	}
	// The same samples with 10,000 goroutines started since the one
	// before: a burst under way is never trimmed.
	for _, c := range cases {
		last := quiet
		last.goroutines = c.now.goroutines
		c.now.goroutines += 10000
		if shouldTrim(c.now, last, c.since) {
			t.Errorf("%s, 10,000 goroutines more than the sample before: shouldTrim = true, want false", c.name)
		}
	}
}

// TestTrimMemoryReturnsABurst drops 64 MiB of garbage that no collection
// has seen and checks that the trimmer gives it back, then that it ends
// with its context.
func TestTrimMemoryReturnsABurst(t *testing.T) {
	runtime.GC()
	startTrimmer(t, 20*time.Millisecond)

	burst := make([][]byte, 64)
	for i := range burst {
		burst[i] = make([]byte, 1<<20)
		burst[i][0] = 1 // touch it, as a copy buffer would be
	}
	peak := readHeap().heap
	runtime.KeepAlive(burst)

	deadline := time.Now().Add(5 * time.Second)
	for {
		held := readHeap().heap
		if held+32<<20 < peak {
			t.Logf("held %d MiB at the peak, %d MiB after the trim", peak>>20, held>>20)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("held %d MiB at the peak and still %d MiB after 5 s", peak>>20, held>>20)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestReleaseWhenReadyWaitsForReadyAndEndsWithItsContext(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	var calls atomic.Int32
	ready := func() bool { return calls.Add(1) >= 3 }
	done := make(chan struct{})
	go func() { defer close(done); releaseWhenReady(context.Background(), ready, log) }()
	select {
	case <-done:
		if n := calls.Load(); n < 3 {
			t.Fatalf("returned after %d readiness checks, before ready", n)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("releaseWhenReady did not return once ready")
	}

	ctx, cancel := context.WithCancel(context.Background())
	done = make(chan struct{})
	go func() { defer close(done); releaseWhenReady(ctx, func() bool { return false }, log) }()
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("releaseWhenReady did not end with its context")
	}
}
