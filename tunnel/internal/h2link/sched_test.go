package h2link

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// slowConn is a link of rate bytes per second: each write waits as long
// as its bytes take to send.
type slowConn struct {
	net.Conn
	rate float64
}

func (c slowConn) Write(p []byte) (int, error) {
	time.Sleep(time.Duration(float64(len(p)) / c.rate * float64(time.Second)))
	return c.Conn.Write(p)
}

// zeros is an endless upload.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }
func (zeros) Close() error               { return nil }

// TestSmallWriteGoesBeforeBulkTurns: on a slow link (8 MB/s) carrying
// four bulk uploads, a 64-byte write on another stream goes out ahead of
// the bulk streams' waiting turns: the bulk bytes that reach the peer
// between the small write and its arrival are at most the turn in
// progress, not a turn of every bulk stream. Counted in bytes, not time,
// so a busy machine does not change the answer.
func TestSmallWriteGoesBeforeBulkTurns(t *testing.T) {
	checkNoLeaks(t)
	near, far := connPair(t, "tcp", "127.0.0.1:0")
	var wg sync.WaitGroup
	spawn := func(f func()) { wg.Add(1); go func() { defer wg.Done(); f() }() }
	var bulkIn atomic.Int64
	arrived := make(chan int64, 16)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		buf := make([]byte, MaxFrameSize)
		for {
			n, err := r.Body.Read(buf)
			if r.Host == "probe:1" && n > 0 {
				arrived <- bulkIn.Load()
			} else {
				bulkIn.Add(int64(n))
			}
			if err != nil {
				return
			}
		}
	})
	served := make(chan *Conn, 1)
	go func() {
		s, err := NewServer(far, Config{Spawn: spawn}, handler)
		if err != nil {
			t.Error(err)
			served <- nil
			return
		}
		served <- s
		s.Serve()
	}()
	c, err := NewClient(slowConn{Conn: near, rate: 8e6}, Config{Spawn: spawn})
	if err != nil {
		t.Fatal(err)
	}
	s := <-served
	defer func() { c.Close(); s.Close(); wg.Wait() }()
	open := func(host string, body io.ReadCloser) {
		t.Helper()
		req := (&http.Request{Method: http.MethodConnect, URL: &url.URL{Host: host}, Host: host, Header: http.Header{}, Body: body}).WithContext(context.Background())
		if _, err := c.RoundTrip(req); err != nil {
			t.Fatal(err)
		}
	}
	pr, pw := io.Pipe()
	defer pw.Close()
	open("probe:1", pr)
	for range 4 {
		open("bulk:1", zeros{})
	}
	for bulkIn.Load() < 1<<20 { // the bulk streams are under way
		time.Sleep(5 * time.Millisecond)
	}
	var ahead []int64
	for range 10 {
		before := bulkIn.Load()
		if _, err := pw.Write(make([]byte, 64)); err != nil {
			t.Fatal(err)
		}
		select {
		case at := <-arrived:
			ahead = append(ahead, at-before)
		case <-time.After(10 * time.Second):
			t.Fatal("the small write did not arrive")
		}
		time.Sleep(10 * time.Millisecond)
	}
	slices.Sort(ahead)
	t.Logf("bulk bytes that arrived before each small write: %v", ahead)
	// The turn in progress is at most one copy buffer (64 KiB) of one
	// bulk stream; waiting behind the other three's turns too would be
	// four times that.
	if median := ahead[len(ahead)/2]; median > 2*MaxFrameSize {
		t.Errorf("median %d bulk bytes went before a small write, want at most %d (the turn in progress)", median, 2*MaxFrameSize)
	}
}

// TestWriteLockServesSmallWritesFirst: a held write lock goes next to the
// oldest urgent waiter, then bulk turns in the order they asked.
func TestWriteLockServesSmallWritesFirst(t *testing.T) {
	var w writeLock
	w.Lock()
	var order []string
	var mu sync.Mutex
	var wg sync.WaitGroup
	waiters := func() int { w.mu.Lock(); defer w.mu.Unlock(); return len(w.urgent) + len(w.bulk) }
	start := func(name string, bulk bool) {
		n := waiters()
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.lock(bulk)
			mu.Lock()
			order = append(order, name)
			mu.Unlock()
			w.Unlock()
		}()
		for waiters() == n { // queued before the next one asks
			time.Sleep(time.Millisecond)
		}
	}
	start("bulk1", true)
	start("bulk2", true)
	start("small1", false)
	start("bulk3", true)
	start("small2", false)
	w.Unlock()
	wg.Wait()
	want := []string{"small1", "small2", "bulk1", "bulk2", "bulk3"}
	if !slices.Equal(order, want) {
		t.Fatalf("turns went %v, want %v", order, want)
	}
	if w.taken || w.urgent != nil || w.bulk != nil {
		t.Fatalf("after the last turn: taken %v, %d urgent, %d bulk waiting; want a free lock holding no queue", w.taken, len(w.urgent), len(w.bulk))
	}
}

// TestTurnsFollowTheLink: a turn that takes long on a slow link makes
// the next ones smaller, down to minTurn, and the socket's unsent bound
// with them; one long pause among quick turns does not; quick turns grow
// back to maxTurn.
func TestTurnsFollowTheLink(t *testing.T) {
	near, far := connPair(t, "tcp", "127.0.0.1:0")
	defer far.Close()
	l, err := NewClient(near, Config{Batch: NewBatcher(near)})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	lowat := func() int {
		var v int
		l.tcp.Control(func(fd uintptr) { v, _ = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT) })
		return v
	}
	if l.turnBytes() != maxTurn || lowat() != fastUnsent {
		t.Fatalf("a new link: turn %d, unsent bound %d; want %d and %d", l.turnBytes(), lowat(), maxTurn, fastUnsent)
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	quick := func(turns int) {
		for range turns {
			l.paceWLocked(l.turnBytes(), 100*time.Microsecond)
		}
	}
	quick(4 * paceTurns)
	l.paceWLocked(maxTurn, 30*time.Millisecond) // a pause of the machine
	quick(4 * paceTurns)
	if l.turnBytes() != maxTurn {
		t.Errorf("after one pause among quick turns: turn %d, want %d", l.turnBytes(), maxTurn)
	}
	for range 8 {
		l.paceWLocked(l.turnBytes(), time.Duration(float64(l.turnBytes())/4e6*float64(time.Second))) // 4 MB/s: 8 KiB in 2 ms
	}
	if l.turnBytes() != minTurn || lowat() != minTurn {
		t.Errorf("on a 4 MB/s link: turn %d, unsent bound %d; want %d", l.turnBytes(), lowat(), minTurn)
	}
	quick(40 * paceTurns)
	if l.turnBytes() != maxTurn || lowat() != fastUnsent {
		t.Errorf("after quick turns: turn %d, unsent bound %d; want %d and %d", l.turnBytes(), lowat(), maxTurn, fastUnsent)
	}
}

// TestWindowsFollowTheLink drives the measurement with the round trips
// and byte counts of a 100 MB/s link with a 50 ms round trip: the
// connection window doubles while it is the limit, comes down to what the
// link carries in its round trip plus queueTarget once a queue builds at
// the link's speed, holds when a trip is long because the machine was
// busy (the speed fell with it), and stays within its bounds; the stream
// window is twice the link's bandwidth-delay product.
func TestWindowsFollowTheLink(t *testing.T) {
	near, far := connPair(t, "tcp", "127.0.0.1:0")
	defer far.Close()
	l, err := NewClient(near, Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	now := time.Now()
	// trip measures one round trip of rtt that brought in n bytes.
	trip := func(rtt time.Duration, n int64) {
		t.Helper()
		l.mu.Lock()
		defer l.mu.Unlock()
		l.bdp.acked = time.Time{}
		if !l.bdpDataLocked(n, now) {
			t.Fatal("no measurement started")
		}
		now = now.Add(rtt)
		l.bdpAckLocked(now)
	}
	target := func() int64 { l.mu.Lock(); defer l.mu.Unlock(); return int64(l.recvTarget) }
	if target() != startConnWindow {
		t.Fatalf("start: %d, want %d", target(), startConnWindow)
	}
	// Below the link's 5 MB in flight the window is the limit: a trip
	// brings in the whole window, and it doubles.
	for w := target(); w < 5e6; w = target() {
		trip(50*time.Millisecond, w)
		if target() != 2*w {
			t.Fatalf("window-limited at %d: %d, want %d", w, target(), 2*w)
		}
	}
	// 8 MiB is past it: the trip takes 84 ms at 100 MB/s. The window
	// comes down to 100 MB/s × (50 + 5) ms.
	trip(84*time.Millisecond, 8.4e6)
	if got, want := target(), int64(100e6*0.055); got != want {
		t.Errorf("after a queue: %d, want %d", got, want)
	}
	if got := l.streamTarget.Load(); got != 10e6 {
		t.Errorf("stream window %d, want twice 5 MB", got)
	}
	// A busy machine: a 200 ms trip at a quarter of the speed.
	w := target()
	trip(200*time.Millisecond, 5e6)
	if target() != w {
		t.Errorf("after a trip long because of the machine: %d, want %d as it was", target(), w)
	}
	// Minutes later, a slow link: the window falls to its floor, the
	// stream window to Config.StreamWindow.
	now = now.Add(5 * time.Minute)
	for range 20 {
		trip(400*time.Millisecond, 1000)
	}
	if got := target(); got != minConnWindow {
		t.Errorf("a slow link: %d, want the floor %d", got, minConnWindow)
	}
	if got := l.streamTarget.Load(); got != DefaultStreamWindow {
		t.Errorf("a slow link's stream window %d, want %d", got, DefaultStreamWindow)
	}
}

// A round trip during which this end sent bulk too waited behind its own
// bytes as well: that queue is the peer's window's to govern. Echoing
// tunnels keep both directions full; were such trips read as a queue,
// each end would shrink its window for the other's bytes until both sat
// at the floor.
func TestTwoWayTripIsNoQueue(t *testing.T) {
	l := &Conn{recvTarget: maxAutoWindow, cfg: Config{}.withDefaults()}
	l.bdp.on = true
	now := time.Now()
	trip := func(rtt time.Duration, in, out int64) {
		t.Helper()
		l.bdp.acked = time.Time{}
		if !l.bdpDataLocked(in, now) {
			t.Fatal("no measurement started")
		}
		l.bdp.wrote += out
		now = now.Add(rtt)
		l.bdpAckLocked(now)
	}
	// A quiet link: 1 ms round trips at 1 GB/s set the shortest trip and
	// the link's speed.
	trip(time.Millisecond, 1e6, 0)
	w := l.recvTarget
	// 30 ms trips at that speed (less than the window: no growth) while
	// this end sends as much as it gets.
	for range 10 {
		trip(30*time.Millisecond, 30e6, 30e6)
	}
	if l.recvTarget < w {
		t.Errorf("after two-way trips: window %d, want at least %d as it was", l.recvTarget, w)
	}
	// The same trips one way are a queue of this window's making.
	trip(30*time.Millisecond, 30e6, 0)
	if l.recvTarget >= w {
		t.Errorf("after a one-way queue: window %d, want it below %d", l.recvTarget, w)
	}
}

// TestWriteLockGiveUp: a waiter with a deadline leaves the queue when it
// ends, and the waiters after it are served in order; one given the
// lock as it gave up gives it to the next.
func TestWriteLockGiveUp(t *testing.T) {
	var w writeLock
	w.Lock()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := w.lockContext(ctx, 0); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("lockContext on a held lock: %v, want the deadline", err)
	}
	if w.takenFor(time.Now()) <= 0 {
		t.Fatal("a taken lock reports no owner")
	}
	got := make(chan struct{})
	go func() { w.Lock(); close(got) }()
	waitUntil(t, 5*time.Second, "the second waiter queues", func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return len(w.urgent) == 1
	})
	w.Unlock()
	<-got
	if err := w.lockContext(context.Background(), 10*time.Millisecond); err == nil {
		t.Fatal("lockContext with a stall bound got a lock held past it")
	} else if !errors.Is(err, ErrStalled) {
		t.Fatalf("lockContext with a stall bound: %v, want ErrStalled", err)
	}
	w.Unlock()
	if w.takenFor(time.Now()) != 0 {
		t.Fatal("a free lock reports an owner")
	}
	if err := w.lockContext(context.Background(), time.Second); err != nil {
		t.Fatalf("lockContext on a free lock: %v", err)
	}
	w.Unlock()
	// Handed over while giving up: the lock goes on, not lost.
	w.Lock()
	tw := turnWaiters.Get().(*turnWaiter)
	w.mu.Lock()
	w.urgent = append(w.urgent, tw)
	w.mu.Unlock()
	w.Unlock() // gives it to tw
	if err := w.giveUp(tw, context.Canceled); !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), time.Second)
	defer cancel2()
	if err := w.lockContext(ctx2, 0); err != nil {
		t.Fatalf("the lock was lost by a waiter that gave up as it was given it: %v", err)
	}
	w.Unlock()
}
