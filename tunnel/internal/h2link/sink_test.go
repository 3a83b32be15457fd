package h2link

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// tcpPair returns both ends of a loopback TCP connection, closed at cleanup.
func tcpPair(t *testing.T) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	near, far := connPair(t, "tcp", "127.0.0.1:0")
	t.Cleanup(func() { near.Close(); far.Close() })
	return near.(*net.TCPConn), far.(*net.TCPConn)
}

// unixPair returns both ends of a Unix stream socket, closed at cleanup.
// Slow-reader tests use it: loopback TCP with tiny buffers stalls on its
// own (windows below one segment wait for the persist timer).
func unixPair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	near, far := connPair(t, "unix", filepath.Join(t.TempDir(), "s"))
	t.Cleanup(func() { near.Close(); far.Close() })
	return near.(*net.UnixConn), far.(*net.UnixConn)
}

// countSpawns makes the link count the goroutines it starts from now on.
func countSpawns(l *Conn) *atomic.Int64 {
	var n atomic.Int64
	inner := l.cfg.Spawn
	l.cfg.Spawn = func(f func()) { n.Add(1); inner(f) }
	return &n
}

// sinkEnd records what a delivery's after hook was told.
type sinkEnd struct {
	called atomic.Int64
	err    atomic.Value
}

func (e *sinkEnd) after(err error) error {
	e.called.Add(1)
	if err != nil {
		e.err.Store(err)
	}
	return err
}

func waitDelivery(t *testing.T, d *Delivery) (int64, error) {
	t.Helper()
	select {
	case <-d.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("delivery did not end within 5s")
	}
	return d.Result()
}

// A small payload on a socket with room goes out from the read loop: no
// goroutine is started, and END_STREAM reaches the far side as a half-close.
func TestSinkWritesInlineAndPassesHalfClose(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	h, resp := openAnswered(t, l, a)
	spawns := countSpawns(l)
	near, far := tcpPair(t)
	var end sinkEnd
	d := resp.Body.(*Body).DeliverTo(near, func(err error) error {
		if err == nil {
			near.CloseWrite()
		}
		return end.after(err)
	})
	a.fr.WriteData(h.StreamID, false, []byte("hello, "))
	a.fr.WriteData(h.StreamID, true, []byte("world"))
	far.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(far) // EOF: the half-close arrived
	if err != nil || string(got) != "hello, world" {
		t.Fatalf("far side read %q, %v", got, err)
	}
	n, err := waitDelivery(t, d)
	if err != nil || n != 12 || end.called.Load() != 1 {
		t.Fatalf("delivery: %d bytes, %v, after called %d times", n, err, end.called.Load())
	}
	if s := spawns.Load(); s != 0 {
		t.Fatalf("%d goroutines started for a socket with room", s)
	}
	// The far side can still send: only one direction ended.
	if _, err := far.Write([]byte("x")); err != nil {
		t.Fatalf("far side write after the half-close: %v", err)
	}
}

// A socket that does not keep up gets a writer goroutine: every byte
// arrives in order, and the writer ends once it caught up.
func TestSinkSlowSocketKeepsOrderAndEndsWriter(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	h, resp := openAnswered(t, l, a)
	spawns := countSpawns(l)
	near, far := unixPair(t)
	near.SetWriteBuffer(4 << 10)
	d := resp.Body.(*Body).DeliverTo(near, func(err error) error {
		if err == nil {
			near.CloseWrite()
		}
		return err
	})
	want := make([]byte, 768<<10) // within the 1 MiB stream window: the fake agent never waits
	for i := range want {
		want[i] = byte(i*7 + i>>11)
	}
	for p := want; len(p) > 0; {
		n := min(len(p), 16<<10)
		if err := a.fr.WriteData(h.StreamID, n == len(p), p[:n]); err != nil {
			t.Fatal(err)
		}
		p = p[n:]
	}
	// Nobody reads yet: the socket fills and the rest waits in the queue.
	time.Sleep(100 * time.Millisecond)
	if spawns.Load() == 0 {
		t.Fatal("no writer goroutine although the socket was full")
	}
	select {
	case <-d.Done():
		t.Fatal("delivery ended while bytes were still queued")
	default:
	}
	far.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(far)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("far side read %d bytes (equal %v), %v", len(got), bytes.Equal(got, want), err)
	}
	if n, err := waitDelivery(t, d); err != nil || n != int64(len(want)) {
		t.Fatalf("delivery: %d bytes, %v", n, err)
	}
	// The stream's credit came back: the agent may send a full window again.
	st := resp.Body.(*Body).st
	st.rmu.Lock()
	window, unacked := st.recvWindow.avail(), st.unacked
	st.rmu.Unlock()
	if window+unacked != DefaultStreamWindow {
		t.Fatalf("window %d + unacked %d, want %d", window, unacked, DefaultStreamWindow)
	}
}

// A socket that refuses a write (its peer reset it) ends the delivery with
// that error and resets the stream, so the agent stops sending.
func TestSinkBrokenSocketResetsStream(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	h, resp := openAnswered(t, l, a)
	near, far := tcpPair(t)
	var end sinkEnd
	d := resp.Body.(*Body).DeliverTo(near, end.after)
	far.SetLinger(0)
	far.Close() // RST: the next write fails
	time.Sleep(20 * time.Millisecond)
	chunk := make([]byte, 16<<10)
	for range 4 {
		a.fr.WriteData(h.StreamID, false, chunk)
	}
	if _, err := waitDelivery(t, d); err == nil {
		t.Fatal("delivery to a reset socket ended without an error")
	}
	for {
		f := a.next()
		if rst, ok := f.(*http2.RSTStreamFrame); ok {
			if rst.StreamID != h.StreamID || rst.ErrCode != http2.ErrCodeCancel {
				t.Fatalf("RST_STREAM %d %v, want %d CANCEL", rst.StreamID, rst.ErrCode, h.StreamID)
			}
			break
		}
	}
	if end.called.Load() != 1 {
		t.Fatalf("after called %d times", end.called.Load())
	}
	if !l.CanTakeNewRequest() {
		t.Fatal("one broken socket took the link down")
	}
}

// An agent reset ends the delivery with an error once what was queued
// before it was written: the socket's reader gets every byte the agent
// sent, then the error is reported.
func TestSinkAgentResetAfterQueuedBytes(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	h, resp := openAnswered(t, l, a)
	near, far := unixPair(t)
	near.SetWriteBuffer(4 << 10)
	d := resp.Body.(*Body).DeliverTo(near, func(err error) error {
		if err != nil {
			near.Close() // what the callers do: the far side sees the end
		}
		return err
	})
	want := bytes.Repeat([]byte("0123456789abcdef"), 16<<10) // 256 KiB
	for p := want; len(p) > 0; p = p[16<<10:] {
		a.fr.WriteData(h.StreamID, false, p[:16<<10])
	}
	a.fr.WriteRSTStream(h.StreamID, http2.ErrCodeInternal)
	time.Sleep(50 * time.Millisecond)
	far.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, _ := io.ReadAll(far)
	if !bytes.Equal(got, want) {
		t.Fatalf("far side read %d of %d bytes before the reset", len(got), len(want))
	}
	_, err := waitDelivery(t, d)
	if !errors.Is(err, ErrStreamReset) {
		t.Fatalf("delivery ended with %v, want a stream reset", err)
	}
}

// A destination that is not a plain socket is served by a copying goroutine
// with the same contract.
func TestSinkFallbackForOtherConns(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	h, resp := openAnswered(t, l, a)
	near, far := net.Pipe()
	defer near.Close()
	defer far.Close()
	d := resp.Body.(*Body).DeliverTo(near, func(err error) error {
		if err == nil {
			near.Close()
		}
		return err
	})
	a.fr.WriteData(h.StreamID, true, []byte("piped"))
	far.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(far)
	if err != nil || string(got) != "piped" {
		t.Fatalf("far side read %q, %v", got, err)
	}
	if n, err := waitDelivery(t, d); err != nil || n != 5 {
		t.Fatalf("delivery: %d bytes, %v", n, err)
	}
}

// sinkFrameSeeds are FuzzSinkFrames' seeds: DATA on the answered stream
// (with END_STREAM, padding, empty, more than the socket holds) and
// RST_STREAM. Small, because the fuzzer minimizes what it finds byte by
// byte; the window overrun has its own test (TestLinkOverrunWindowResetsStreamOnly).
func sinkFrameSeeds() [][]byte {
	var out [][]byte
	seed := func(write func(fr *http2.Framer)) []byte {
		var b bytes.Buffer
		write(http2.NewFramer(&b, nil))
		return b.Bytes()
	}
	big := bytes.Repeat([]byte("0123456789abcdef"), 1024) // 16 KiB
	out = append(out, seed(func(fr *http2.Framer) {
		fr.WriteData(1, false, []byte("hello"))
		fr.WriteData(1, true, []byte("world"))
	}))
	out = append(out, seed(func(fr *http2.Framer) {
		for range 12 { // more than the socket holds: a writer takes over
			fr.WriteData(1, false, big)
		}
		fr.WriteRSTStream(1, http2.ErrCodeCancel)
	}))
	out = append(out, seed(func(fr *http2.Framer) {
		fr.WriteDataPadded(1, false, []byte("padded"), make([]byte, 200))
		fr.WriteData(1, false, nil)
		fr.WriteData(1, true, big)
		fr.WriteData(1, false, []byte("after the end"))
	}))
	return out
}

// FuzzSinkFrames feeds arbitrary frames to a link whose answered stream
// delivers into a socket with a small buffer (so both the read loop's
// inline writes and the writer goroutine run): nothing may panic or hang,
// the delivery always ends, and the socket receives no more than the
// agent's DATA carried.
func FuzzSinkFrames(f *testing.F) {
	for _, s := range sinkFrameSeeds() {
		f.Add(s)
	}
	f.Fuzz(sinkFramesOnce)
}

// sinkFramesOnce is one FuzzSinkFrames input.
func sinkFramesOnce(t *testing.T, data []byte) {
	l, a := newLinkPair(t, 0, 0)
	_, resp := openAnswered(t, l, a)
	near, far := unixPair(t)
	near.SetWriteBuffer(4 << 10)
	d := resp.Body.(*Body).DeliverTo(near, func(err error) error {
		if err == nil {
			near.CloseWrite()
		} else {
			near.Close()
		}
		return err
	})
	got := make(chan int64, 1)
	go func() {
		far.SetReadDeadline(time.Now().Add(10 * time.Second))
		n, _ := io.Copy(io.Discard, far)
		got <- n
	}()
	a.conn.SetWriteDeadline(time.Now().Add(2 * time.Second))
	a.conn.Write(data)
	a.conn.Close() // then the connection ends
	select {
	case <-d.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("delivery did not end after the link's connection closed")
	}
	near.Close()
	written, _ := d.Result()
	if n := <-got; n != written {
		t.Fatalf("the socket received %d bytes, the delivery counted %d", n, written)
	}
	if written > int64(len(data)) {
		t.Fatalf("%d bytes delivered from %d bytes of frames", written, len(data))
	}
	waitLinkEnded(t, l, "link did not end with its connection")
}

// TestDeliveryWaitWritten: a waiter wakes when the count it waits for is
// written, not before; and fails when more was written, when the delivery
// ends short, or when its context ends.
func TestDeliveryWaitWritten(t *testing.T) {
	d := NewDelivery()
	d.Add(3)
	if err := d.WaitWritten(context.Background(), 3); err != nil {
		t.Fatalf("3 of 3 bytes written: %v", err)
	}
	waited := make(chan error, 1)
	go func() { waited <- d.WaitWritten(context.Background(), 10) }()
	d.Add(4)
	select {
	case err := <-waited:
		t.Fatalf("returned at 7 of 10 bytes: %v", err)
	default:
	}
	d.Add(3)
	if err := <-waited; err != nil {
		t.Fatalf("10 of 10 bytes written: %v", err)
	}
	if err := d.WaitWritten(context.Background(), 8); err == nil {
		t.Error("10 bytes written, 8 expected: no error")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := d.WaitWritten(ctx, 20); !errors.Is(err, context.Canceled) {
		t.Errorf("context ended: %v", err)
	}
	go d.Complete(nil)
	if err := d.WaitWritten(context.Background(), 20); err == nil || !strings.Contains(err.Error(), "ended after 10 of 20") {
		t.Errorf("delivery ended short: %v", err)
	}
}

// Config.Queued counts what waits in a stream's queue for a socket that
// does not keep up, or for a reader, and nothing once it was written, read
// or dropped.
func TestQueuedCounted(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	var queued atomic.Int64
	l.cfg.Queued = &queued
	// A socket that stalls, then reads everything.
	h, resp := openAnswered(t, l, a)
	near, far := unixPair(t)
	near.SetWriteBuffer(4 << 10)
	d := resp.Body.(*Body).DeliverTo(near, func(err error) error { return err })
	payload := make([]byte, 512<<10)
	for p := payload; len(p) > 0; p = p[16<<10:] {
		if err := a.fr.WriteData(h.StreamID, len(p) == 16<<10, p[:16<<10]); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for queued.Load() < 256<<10 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if q := queued.Load(); q < 256<<10 || q > int64(len(payload)) {
		t.Fatalf("%d bytes counted queued behind a full socket, want most of %d", q, len(payload))
	}
	far.SetReadDeadline(time.Now().Add(10 * time.Second))
	if got, err := io.ReadAll(io.LimitReader(far, int64(len(payload)))); err != nil || len(got) != len(payload) {
		t.Fatalf("far side read %d bytes, %v", len(got), err)
	}
	if _, err := waitDelivery(t, d); err != nil {
		t.Fatal(err)
	}
	if q := queued.Load(); q != 0 {
		t.Fatalf("%d bytes counted queued once all was written", q)
	}
}

// Config.Queued counts what a reader has not read yet, and nothing once
// the body is closed with bytes still queued.
func TestQueuedCountedForReader(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	var queued atomic.Int64
	l.cfg.Queued = &queued
	h2, resp2 := openAnswered(t, l, a)
	if err := a.fr.WriteData(h2.StreamID, false, make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for queued.Load() < 1000 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	buf := make([]byte, 300)
	if _, err := io.ReadFull(resp2.Body, buf); err != nil {
		t.Fatal(err)
	}
	if q := queued.Load(); q != 700 {
		t.Fatalf("%d bytes counted queued after reading 300 of 1000, want 700", q)
	}
	resp2.Body.Close()
	if q := queued.Load(); q != 0 {
		t.Fatalf("%d bytes counted queued after the body was closed", q)
	}
}
