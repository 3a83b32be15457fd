package testnet

import (
	"runtime"
	"strings"
	"testing"
	"time"
)

// CheckNoLeaks fails the test if goroutines started during it are still
// running 5 s after its cleanups began (the cleanup registered here runs
// after those registered later, so every server the test started is
// closed by then).
func CheckNoLeaks(t testing.TB) {
	t.Helper()
	base := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for {
			n := runtime.NumGoroutine()
			if n <= base {
				return
			}
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Errorf("goroutines: %d at start, %d after cleanup\n%s", base, n, OnlyOurs(string(buf)))
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

// OnlyOurs keeps the goroutine stacks of a runtime.Stack dump that run
// this module's code or x/net's HTTP/2 pieces.
func OnlyOurs(stacks string) string {
	var keep []string
	for _, g := range strings.Split(stacks, "\n\n") {
		if strings.Contains(g, "konnectivity") || strings.Contains(g, "http2") {
			keep = append(keep, g)
		}
	}
	return strings.Join(keep, "\n\n")
}
