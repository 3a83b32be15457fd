package testnet

import (
	"io"
	"net"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

// Close ends the listener, every open connection and every handler, even
// handlers blocked reading a connection whose peer stays silent.
func TestCloseEndsEverything(t *testing.T) {
	base := runtime.NumGoroutine()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var ended atomic.Int32
	s := Serve(ln, func(c net.Conn) {
		io.Copy(io.Discard, c)
		ended.Add(1)
	})
	var clients []net.Conn
	for range 3 {
		c, err := net.Dial("tcp", s.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.Active() != 3 {
		if time.Now().After(deadline) {
			t.Fatalf("%d handlers running, want 3", s.Active())
		}
		time.Sleep(5 * time.Millisecond)
	}
	clients[0].Close() // a handler that ends by itself leaves Active
	for s.Active() != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("%d handlers running after one client left, want 2", s.Active())
		}
		time.Sleep(5 * time.Millisecond)
	}
	s.Close()
	if n := ended.Load(); n != 3 {
		t.Fatalf("%d handlers returned by Close, want 3", n)
	}
	if _, err := net.Dial("tcp", s.Addr()); err == nil {
		t.Fatal("listener still accepts after Close")
	}
	s.Close() // twice is fine
	for runtime.NumGoroutine() > base {
		if time.Now().After(deadline) {
			t.Fatalf("goroutines: %d before, %d after Close", base, runtime.NumGoroutine())
		}
		time.Sleep(5 * time.Millisecond)
	}
}
