package h2link

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"sync"
	"testing"
)

// BenchmarkLinkEcho sends 64 KiB through one tunnel between a client end
// and a serving end that echoes it, and reads it back: the byte path's
// cost per DATA frame each way (allocations are the figure to watch).
func BenchmarkLinkEcho(b *testing.B) {
	near, far := connPair(b, "tcp", "127.0.0.1:0")
	var wg sync.WaitGroup
	spawn := func(f func()) { wg.Add(1); go func() { defer wg.Done(); f() }() }
	echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		buf := make([]byte, MaxFrameSize)
		for {
			n, err := r.Body.Read(buf)
			if n > 0 {
				if _, werr := w.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	})
	served := make(chan *Conn, 1)
	go func() {
		s, err := NewServer(far, Config{Spawn: spawn}, echo)
		if err != nil {
			b.Error(err)
			served <- nil
			return
		}
		served <- s
		s.Serve()
	}()
	c, err := NewClient(near, Config{Spawn: spawn})
	if err != nil {
		b.Fatal(err)
	}
	s := <-served
	defer func() { c.Close(); s.Close(); wg.Wait() }()
	pr, pw := io.Pipe()
	req := (&http.Request{Method: http.MethodConnect, URL: &url.URL{Host: "x:1"}, Host: "x:1", Header: http.Header{}, Body: pr}).WithContext(context.Background())
	resp, err := c.RoundTrip(req)
	if err != nil {
		b.Fatal(err)
	}
	chunk := make([]byte, MaxFrameSize)
	back := make([]byte, MaxFrameSize)
	b.SetBytes(MaxFrameSize)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if _, err := pw.Write(chunk); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(resp.Body, back); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	pw.Close()
	resp.Body.Close()
}
