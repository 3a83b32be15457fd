package h2link

import (
	"net"
	"runtime"
	"strings"
	"testing"
	"time"
)

// connPair listens on network and address, dials it and returns both ends
// (the dialled one first); the caller closes them.
func connPair(t testing.TB, network, address string) (near, far net.Conn) {
	t.Helper()
	ln, err := net.Listen(network, address)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	near, err = net.Dial(network, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	far = <-accepted
	if far == nil {
		near.Close()
		t.Fatal("accept failed")
	}
	return near, far
}

// checkNoLeaks fails the test if goroutines started during it are still
// running once everything has been closed.
func checkNoLeaks(t *testing.T) {
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
				t.Errorf("goroutines: %d at start, %d after cleanup\n%s", base, n, onlyOurs(string(buf)))
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

func onlyOurs(stacks string) string {
	var keep []string
	for _, g := range strings.Split(stacks, "\n\n") {
		if strings.Contains(g, "h2link") || strings.Contains(g, "http2") {
			keep = append(keep, g)
		}
	}
	return strings.Join(keep, "\n\n")
}
