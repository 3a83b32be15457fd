//go:build !race

package daemon

// The race detector makes every frame larger, so stack sizes measured
// under it say nothing of the daemons' own: these tests run without it
// (make unit runs them so).

import (
	"runtime"
	"sync"
	"testing"
	"time"
)

// TestTrimMemoryShrinksParkedStacks starts goroutines that grow their
// stacks and then wait, as new tunnels do, and checks that the trimmer
// collects once they are quiet (no collection of its own would come for
// minutes), which halves their stacks.
func TestTrimMemoryShrinksParkedStacks(t *testing.T) {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.StackInuse
	// The trimmer samples first, as in the daemons: the goroutines are new
	// to it.
	startTrimmer(t, 50*time.Millisecond)

	release := make(chan struct{})
	var parked sync.WaitGroup
	var ended sync.WaitGroup
	const n = 2 * trimGoroutines
	for range n {
		parked.Add(1)
		ended.Add(1)
		go func() {
			defer ended.Done()
			growStack(12) // about 6 KiB deep: the stack becomes 8 KiB
			parked.Done()
			<-release
		}()
	}
	parked.Wait()
	defer func() { close(release); ended.Wait() }()

	// Unshrunk, each parked goroutine holds an 8 KiB stack; halved, 4 KiB.
	// The bound is measured from before the goroutines started, since the
	// trimmer may already shrink some while the others are still starting.
	const limit = n * 5 << 10
	deadline := time.Now().Add(5 * time.Second)
	for {
		runtime.ReadMemStats(&ms)
		if ms.StackInuse <= base+limit {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("stacks in use %d KiB over the %d KiB before the goroutines started, limit %d KiB: not shrunk", (ms.StackInuse-base)>>10, base>>10, limit>>10)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
