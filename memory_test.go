package main

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
	cases := []struct {
		name          string
		now, last     heapSample
		heldAfterTrim uint64
		want          bool
	}{
		{"fresh collection, heap near its goal", heapSample{held: 40 * mib, live: 20 * mib, gcCycles: 5}, heapSample{gcCycles: 4}, 4 * mib, false},
		{"fresh collection, far more held than the goal", heapSample{held: 120 * mib, live: 10 * mib, gcCycles: 5}, heapSample{gcCycles: 4}, 4 * mib, true},
		{"no collection, grown since the last trim", heapSample{held: 150 * mib, live: 140 * mib, gcCycles: 4}, heapSample{gcCycles: 4}, 5 * mib, true},
		{"no collection, no growth since the last trim", heapSample{held: 40 * mib, live: 35 * mib, gcCycles: 4}, heapSample{gcCycles: 4}, 38 * mib, false},
		{"small idle daemon", heapSample{held: 6 * mib, live: 2 * mib, gcCycles: 4}, heapSample{gcCycles: 4}, 4 * mib, false},
	}
	for _, c := range cases {
		if got := shouldTrim(c.now, c.last, c.heldAfterTrim); got != c.want {
			t.Errorf("%s: shouldTrim = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestTrimMemoryReturnsABurst drops 64 MiB of garbage that no collection
// has seen and checks that the trimmer gives it back, then that it ends
// with its context.
func TestTrimMemoryReturnsABurst(t *testing.T) {
	runtime.GC()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		trimMemory(ctx, 20*time.Millisecond, slog.New(slog.NewTextHandler(io.Discard, nil)))
	}()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("trimMemory did not end with its context")
		}
	}()

	burst := make([][]byte, 64)
	for i := range burst {
		burst[i] = make([]byte, 1<<20)
		burst[i][0] = 1 // touch it, as a copy buffer would be
	}
	peak := readHeap().held
	runtime.KeepAlive(burst)

	deadline := time.Now().Add(5 * time.Second)
	for {
		held := readHeap().held
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
