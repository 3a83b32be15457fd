package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchdial"
	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

// shape is what each tunnel does with its bytes.
type shape int

const (
	echo shape = iota
	download
	upload
)

var shapeNames = [...]string{"echo", "download", "upload"}

func (s shape) String() string { return shapeNames[s] }

func parseShape(s string) (shape, error) {
	for i, n := range shapeNames {
		if n == s {
			return shape(i), nil
		}
	}
	return 0, fmt.Errorf("unknown shape %q (echo, download, upload)", s)
}

// directions is how many directions carry the run's bytes.
func (s shape) directions() int64 {
	if s == echo {
		return 2
	}
	return 1
}

// The bytes of every tunnel come from one pattern, each tunnel starting at
// its own offset, so a byte delivered to the wrong tunnel or out of order
// is seen. The buffer holds the pattern twice: any run of up to patternLen
// bytes from any offset is one slice.
const (
	patternLen = 256<<10 + 251
	writeSize  = 256 << 10
	readSize   = 64 << 10
)

type pattern []byte

func newPattern() pattern {
	p := make([]byte, 2*patternLen)
	x := uint32(2463534242)
	for i := range patternLen {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		p[i] = byte(x)
	}
	copy(p[patternLen:], p[:patternLen])
	return p
}

func offsetOf(tunnel int) int { return (tunnel * 4099) % patternLen }

// slice is n bytes of the pattern from position pos of a tunnel starting at start.
func (p pattern) slice(start int, pos int64, n int) []byte {
	o := (start + int(pos%patternLen)) % patternLen
	return p[o : o+n]
}

// check reports whether b is the pattern at pos for a tunnel starting at start.
func (p pattern) check(start int, pos int64, b []byte) bool {
	for len(b) > 0 {
		n := min(len(b), patternLen)
		if string(p.slice(start, pos, n)) != string(b[:n]) {
			return false
		}
		b, pos = b[n:], pos+int64(n)
	}
	return true
}

// result is one run of one shape through one implementation.
type result struct {
	impl           string
	shape          shape
	run            int
	tunnels        int
	completed      int
	errors         int
	firstErr       string
	wall           time.Duration // bytes start to the last tunnel's end (or the bound)
	moved          int64         // bytes delivered, every direction
	longestStall   time.Duration // the longest any unfinished tunnel went without progress
	stallAfterHogs time.Duration // the same, counted from the hogs' end
	rssServer      int64         // KiB, VmHWM
	rssAgent       int64
	windowBound    int64 // bytes the stream receive windows let both ends hold
}

func (r result) complete() bool { return r.completed == r.tunnels && r.errors == 0 }

func (r result) mbps() float64 {
	if r.wall <= 0 {
		return 0
	}
	return float64(r.moved) / 1e6 / r.wall.Seconds()
}

func (r result) line() string {
	s := fmt.Sprintf("%s %s run %d: %d/%d completed, %d errors, wall %s, %.1f MB/s, longest stall %s (after hogs %s), peak RSS server %d MiB agent %d MiB",
		r.impl, r.shape, r.run, r.completed, r.tunnels, r.errors, r.wall.Round(100*time.Millisecond), r.mbps(),
		r.longestStall.Round(100*time.Millisecond), r.stallAfterHogs.Round(100*time.Millisecond), r.rssServer>>10, r.rssAgent>>10)
	if r.firstErr != "" {
		s += "; first error: " + r.firstErr
	}
	return s
}

// tunnel is one client connection's progress.
type tunnel struct {
	conn     net.Conn
	index    int
	last     atomic.Int64 // unix nanoseconds of the last byte moved
	finished atomic.Bool
}

func (t *tunnel) progress() { t.last.Store(time.Now().UnixNano()) }

// runOnce starts im, opens every tunnel, then starts their bytes at one
// moment, with the hogs beside them.
func runOnce(ctx context.Context, cfg config, im impl, sh shape, listen func() (net.Listener, error), dir string) (result, error) {
	res := result{impl: im.name, shape: sh, tunnels: cfg.tunnels,
		windowBound: int64(cfg.tunnels) * streamWindow * sh.directions() * 2}
	pat := newPattern()
	dest, err := newDestination(listen, sh, cfg.bytes, pat)
	if err != nil {
		return res, err
	}
	defer dest.close()
	p, err := start(ctx, im, dir, cfg.tunnels)
	if err != nil {
		return res, err
	}
	defer p.stop()

	// Open every tunnel first.
	tuns := make([]*tunnel, cfg.tunnels)
	var wg sync.WaitGroup
	var openErr atomic.Pointer[error]
	for i := range tuns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := benchdial.Connect(ctx, p.sock, dest.addr(), 60*time.Second)
			if err != nil {
				openErr.CompareAndSwap(nil, &err)
				return
			}
			tuns[i] = &tunnel{conn: c, index: i}
		}()
	}
	wg.Wait()
	defer func() {
		for _, t := range tuns {
			if t != nil {
				t.conn.Close()
			}
		}
	}()
	if e := openErr.Load(); e != nil {
		return res, fmt.Errorf("open tunnels: %w", *e)
	}
	time.Sleep(300 * time.Millisecond)

	// Then every tunnel's bytes at once, the hogs beside them.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	hogsDone, err := hogs(ctx, cfg.hogs, cfg.hogFor)
	if err != nil {
		return res, err
	}
	t0 := time.Now()
	deadline := t0.Add(cfg.timeout)
	var moved atomic.Int64
	var completed, failed atomic.Int64
	var firstErr atomic.Pointer[string]
	var lastEnd atomic.Int64
	for _, t := range tuns {
		t.conn.SetDeadline(deadline)
		t.progress()
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := t.move(sh, cfg.bytes, pat, &moved)
			t.finished.Store(true)
			lastEnd.Store(time.Now().UnixNano())
			if err != nil {
				failed.Add(1)
				msg := fmt.Sprintf("tunnel %d: %v", t.index, err)
				firstErr.CompareAndSwap(nil, &msg)
				return
			}
			completed.Add(1)
		}()
	}
	all := make(chan struct{})
	go func() { wg.Wait(); close(all) }() // ends once every tunnel ended: each has the deadline
	res.longestStall, res.stallAfterHogs = watch(all, hogsDone, tuns)
	res.wall = time.Duration(lastEnd.Load() - t0.UnixNano())
	res.completed, res.errors, res.moved = int(completed.Load()), int(failed.Load()), moved.Load()
	if e := firstErr.Load(); e != nil {
		res.firstErr = *e
	}
	res.rssServer, _ = benchproc.StatusKiB(p.server.PID(), "VmHWM:")
	res.rssAgent, _ = benchproc.StatusKiB(p.agent.PID(), "VmHWM:")
	if res.errors > 0 || res.completed < res.tunnels {
		for _, pr := range []*benchproc.Proc{p.server, p.agent} {
			if _, _, sample := pr.LogIssues(5); len(sample) > 0 {
				res.firstErr += fmt.Sprintf("\n  %s log: %v", pr.Name, sample)
			}
		}
	}
	cancel()
	<-hogsDone
	return res, nil
}

// watch samples every unfinished tunnel's time without progress until all
// is closed: the longest over the run, and the longest counted from the
// moment hogsDone closed.
func watch(all <-chan struct{}, hogsDone <-chan struct{}, tuns []*tunnel) (longest, afterHogs time.Duration) {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var hogsEnd int64
	for {
		select {
		case <-all:
			return longest, afterHogs
		case <-tick.C:
		}
		if hogsEnd == 0 {
			select {
			case <-hogsDone:
				hogsEnd = time.Now().UnixNano()
			default:
			}
		}
		now := time.Now().UnixNano()
		for _, t := range tuns {
			if t.finished.Load() {
				continue
			}
			last := t.last.Load()
			longest = max(longest, time.Duration(now-last))
			if hogsEnd != 0 {
				afterHogs = max(afterHogs, time.Duration(now-max(last, hogsEnd)))
			}
		}
	}
}

// move is the client's side of one tunnel.
func (t *tunnel) move(sh shape, size int64, pat pattern, moved *atomic.Int64) error {
	start := offsetOf(t.index)
	c := t.conn
	switch sh {
	case echo:
		errc := make(chan error, 1)
		go func() { errc <- t.send(start, size, pat, moved, false) }() // waited for below
		rerr := t.receive(c, start, size, pat, moved)
		if rerr != nil {
			c.Close() // ends the writer too
		}
		werr := <-errc
		return errors.Join(rerr, werr)
	case download:
		var hdr [8]byte
		binary.BigEndian.PutUint64(hdr[:], uint64(t.index))
		if _, err := c.Write(hdr[:]); err != nil {
			return fmt.Errorf("write header: %w", err)
		}
		if err := t.receive(c, start, size, pat, moved); err != nil {
			return err
		}
		return nil
	default: // upload
		var hdr [8]byte
		binary.BigEndian.PutUint64(hdr[:], uint64(t.index))
		if _, err := c.Write(hdr[:]); err != nil {
			return fmt.Errorf("write header: %w", err)
		}
		if err := t.send(start, size, pat, moved, true); err != nil {
			return err
		}
		var ack [1]byte
		if _, err := io.ReadFull(c, ack[:]); err != nil {
			return fmt.Errorf("read the destination's verdict: %w", err)
		}
		if ack[0] != 'k' {
			return errors.New("the destination received other bytes than were sent")
		}
		return nil
	}
}

func (t *tunnel) send(start int, size int64, pat pattern, moved *atomic.Int64, count bool) error {
	for pos := int64(0); pos < size; {
		n := int(min(size-pos, writeSize))
		if _, err := t.conn.Write(pat.slice(start, pos, n)); err != nil {
			return fmt.Errorf("write at %d of %d: %w", pos, size, err)
		}
		pos += int64(n)
		t.progress()
		if count {
			moved.Add(int64(n))
		}
	}
	return nil
}

func (t *tunnel) receive(r io.Reader, start int, size int64, pat pattern, moved *atomic.Int64) error {
	buf := make([]byte, readSize)
	for pos := int64(0); pos < size; {
		n, err := r.Read(buf[:min(int64(len(buf)), size-pos)])
		if n > 0 {
			if !pat.check(start, pos, buf[:n]) {
				return fmt.Errorf("wrong bytes at %d", pos)
			}
			pos += int64(n)
			moved.Add(int64(n))
			t.progress()
		}
		if err != nil {
			return fmt.Errorf("read at %d of %d: %w", pos, size, err)
		}
	}
	return nil
}

// destination is the server behind the agent.
type destination struct {
	ln   net.Listener
	wg   sync.WaitGroup
	mu   sync.Mutex
	open map[net.Conn]struct{} // under mu: closed by close
}

func newDestination(listen func() (net.Listener, error), sh shape, size int64, pat pattern) (*destination, error) {
	ln, err := listen()
	if err != nil {
		return nil, err
	}
	d := &destination{ln: ln, open: map[net.Conn]struct{}{}}
	d.wg.Add(1)
	go func() { // owned by d: ends when close closes the listener
		defer d.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			d.mu.Lock()
			d.open[c] = struct{}{}
			d.mu.Unlock()
			d.wg.Add(1)
			go func() {
				defer d.wg.Done()
				defer func() {
					d.mu.Lock()
					delete(d.open, c)
					d.mu.Unlock()
					c.Close()
				}()
				serve(c, sh, size, pat)
			}()
		}
	}()
	return d, nil
}

func (d *destination) addr() string { return d.ln.Addr().String() }

func (d *destination) close() {
	d.ln.Close()
	d.mu.Lock()
	for c := range d.open {
		c.Close()
	}
	d.mu.Unlock()
	d.wg.Wait()
}

// serve is the destination's side of one tunnel.
func serve(c net.Conn, sh shape, size int64, pat pattern) {
	if sh == echo {
		buf := make([]byte, 32<<10)
		for {
			n, err := c.Read(buf)
			if n > 0 {
				if _, werr := c.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}
	var hdr [8]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return
	}
	start := offsetOf(int(binary.BigEndian.Uint64(hdr[:])))
	if sh == download {
		for pos := int64(0); pos < size; {
			n := int(min(size-pos, writeSize))
			if _, err := c.Write(pat.slice(start, pos, n)); err != nil {
				return
			}
			pos += int64(n)
		}
		return
	}
	buf := make([]byte, readSize)
	verdict := byte('k')
	for pos := int64(0); pos < size; {
		n, err := c.Read(buf[:min(int64(len(buf)), size-pos)])
		if n > 0 && !pat.check(start, pos, buf[:n]) {
			verdict = 'x'
		}
		pos += int64(n)
		if err != nil {
			return
		}
	}
	c.Write([]byte{verdict})
}
