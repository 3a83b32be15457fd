package main

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"
)

// TestRelayHoldsEveryByte: the relay's copy writes each byte no sooner
// than its hold after it was read, keeps every byte in order, and passes
// the end on. (A lower bound only: a busy machine can make it later.)
func TestRelayHoldsEveryByte(t *testing.T) {
	in, feed := net.Pipe()
	out, drain := net.Pipe()
	t.Cleanup(func() { feed.Close(); drain.Close() })
	drain.SetReadDeadline(time.Now().Add(30 * time.Second))
	const hold = 30 * time.Millisecond
	start := time.Now() // before anything is read: no byte may come before start+hold
	done := make(chan struct{})
	go func() { defer close(done); delayCopy(out, in, hold); out.Close() }()
	want := bytes.Repeat([]byte("konnectivity"), 10000)
	go func() {
		for p := want; len(p) > 0; p = p[min(len(p), 4096):] {
			feed.Write(p[:min(len(p), 4096)])
		}
		feed.Close()
	}()
	first := make([]byte, 1)
	if _, err := io.ReadFull(drain, first); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < hold {
		t.Errorf("the first byte came after %v, before the %v hold", took, hold)
	}
	rest, err := io.ReadAll(drain)
	if err != nil {
		t.Fatal(err)
	}
	if got := append(first, rest...); !bytes.Equal(got, want) {
		t.Errorf("%d bytes through the relay, want the %d sent, in order", len(got), len(want))
	}
	<-done
}
