package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchdial"
)

const (
	dialTimeout = 15 * time.Second // CONNECT answered (the agent dials within it)
	echoTimeout = 10 * time.Second // one small echo round trip
)

// dialer opens a byte stream to a destination address: either through the
// tunnel (CONNECT on the server's Unix socket) or directly over TCP.
type dialer func(ctx context.Context, target string) (net.Conn, error)

func directDialer(ctx context.Context, target string) (net.Conn, error) {
	d := net.Dialer{Timeout: dialTimeout}
	c, err := d.DialContext(ctx, "tcp", target)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", target, err)
	}
	return c, nil
}

// tunnelDialer dials through the HTTP CONNECT front door on the server's
// Unix socket, one socket per tunnel, as kube-apiserver does.
func tunnelDialer(sock string) dialer {
	return func(ctx context.Context, target string) (net.Conn, error) {
		return benchdial.Connect(ctx, sock, target, dialTimeout)
	}
}

// percentile is the nearest-rank percentile of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(p/100*float64(len(sorted))+0.999999) - 1
	rank = max(0, min(rank, len(sorted)-1))
	return sorted[rank]
}

func sortDur(d []time.Duration) []time.Duration {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return d
}

// dialEcho dials, echoes one byte and closes; it returns the time from
// dial to the echoed byte.
func dialEcho(ctx context.Context, dial dialer, target string, b byte) (time.Duration, error) {
	t0 := time.Now()
	c, err := dial(ctx, target)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(echoTimeout)); err != nil {
		return 0, err
	}
	if _, err := c.Write([]byte{b}); err != nil {
		return 0, fmt.Errorf("echo write: %w", err)
	}
	var got [1]byte
	if _, err := io.ReadFull(c, got[:]); err != nil {
		return 0, fmt.Errorf("echo read: %w", err)
	}
	d := time.Since(t0)
	if got[0] != b {
		return 0, fmt.Errorf("echo: sent %#x, got %#x", b, got[0])
	}
	return d, nil
}

// latencyResult is one side of figure 1.
type latencyResult struct {
	sorted   []time.Duration
	errs     int
	firstErr error
}

// measureLatency alternates direct and tunnelled dials so that background
// load on a shared machine hits both sides alike.
func measureLatency(ctx context.Context, tunnel dialer, target string, n int) (tun, dir latencyResult) {
	r := measureLatencyPaths(ctx, target, n, directDialer, tunnel)
	return r[1], r[0]
}

// measureLatencyPaths dials through each path in turn, n rounds, and
// returns one sorted result per path.
func measureLatencyPaths(ctx context.Context, target string, n int, paths ...dialer) []latencyResult {
	res := make([]latencyResult, len(paths))
	for i := 0; i < n && ctx.Err() == nil; i++ {
		for j, dial := range paths {
			r := &res[j]
			d, err := dialEcho(ctx, dial, target, byte(i))
			if err != nil {
				r.errs++
				if r.firstErr == nil {
					r.firstErr = err
				}
				continue
			}
			r.sorted = append(r.sorted, d)
		}
	}
	for j := range res {
		sortDur(res[j].sorted)
	}
	return res
}

func writeLength(c net.Conn, n int64) error {
	var h [8]byte
	binary.BigEndian.PutUint64(h[:], uint64(n))
	if err := c.SetWriteDeadline(time.Now().Add(ioIdle)); err != nil {
		return err
	}
	if _, err := c.Write(h[:]); err != nil {
		return fmt.Errorf("write length: %w", err)
	}
	return nil
}

// download reads n pattern bytes from the source destination and checks
// their CRC; the duration runs from the request to the last byte.
func download(ctx context.Context, dial dialer, pat *pattern, source string, n int64) (time.Duration, error) {
	want := pat.crc(n)
	c, err := dial(ctx, source)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	buf := make([]byte, chunkSize)
	t0 := time.Now()
	if err := writeLength(c, n); err != nil {
		return 0, err
	}
	got, err := readCRC(c, n, buf)
	d := time.Since(t0)
	if err != nil {
		return 0, fmt.Errorf("download: %w", err)
	}
	if got != want {
		return 0, fmt.Errorf("download: CRC-32C %08x, want %08x", got, want)
	}
	return d, nil
}

// upload writes n pattern bytes to the sink destination and checks the CRC
// it answers; the duration runs from the first byte to the answer.
func upload(ctx context.Context, dial dialer, pat *pattern, sink string, n int64) (time.Duration, error) {
	want := pat.crc(n)
	c, err := dial(ctx, sink)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	t0 := time.Now()
	if err := writeLength(c, n); err != nil {
		return 0, err
	}
	if err := pat.writePattern(c, n, nil); err != nil {
		return 0, fmt.Errorf("upload: %w", err)
	}
	var ans [4]byte
	if err := c.SetReadDeadline(time.Now().Add(ioIdle)); err != nil {
		return 0, err
	}
	if _, err := io.ReadFull(c, ans[:]); err != nil {
		return 0, fmt.Errorf("upload: read CRC answer: %w", err)
	}
	d := time.Since(t0)
	if got := binary.BigEndian.Uint32(ans[:]); got != want {
		return 0, fmt.Errorf("upload: sink CRC-32C %08x, want %08x", got, want)
	}
	return d, nil
}

// concurrentResult is figure 4 for one path.
type concurrentResult struct {
	wall     time.Duration
	errs     int
	firstErr error
}

// concurrentEcho starts n tunnels at once, each echoing size distinct bytes,
// and waits for all of them.
func concurrentEcho(ctx context.Context, dial dialer, pat *pattern, target string, n, size int) concurrentResult {
	var (
		wg       sync.WaitGroup
		errs     atomic.Int64
		mu       sync.Mutex
		firstErr error
		start    = make(chan struct{})
	)
	fail := func(err error) {
		errs.Add(1)
		mu.Lock()
		if firstErr == nil {
			firstErr = err
		}
		mu.Unlock()
	}
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			if err := echoOnce(ctx, dial, pat, target, int64(i)*7919, size); err != nil {
				fail(fmt.Errorf("tunnel %d: %w", i, err))
			}
		}()
	}
	t0 := time.Now()
	close(start)
	wg.Wait()
	return concurrentResult{wall: time.Since(t0), errs: int(errs.Load()), firstErr: firstErr}
}

// echoOnce dials target, sends size pattern bytes from offset off while
// reading them back, and compares.
func echoOnce(ctx context.Context, dial dialer, pat *pattern, target string, off int64, size int) error {
	c, err := dial(ctx, target)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(ioIdle)); err != nil {
		return err
	}
	want := make([]byte, 0, size)
	for o := 0; o < size; o += chunkSize {
		want = append(want, pat.window(off+int64(o), min(chunkSize, size-o))...)
	}
	werr := make(chan error, 1)
	go func() {
		_, err := c.Write(want)
		werr <- err
	}()
	got := make([]byte, size)
	_, rerr := io.ReadFull(c, got)
	if rerr != nil {
		c.Close() // unblocks the writer
	}
	if err := <-werr; err != nil && rerr == nil {
		return fmt.Errorf("write: %w", err)
	}
	if rerr != nil {
		return fmt.Errorf("read back: %w", rerr)
	}
	if !bytes.Equal(got, want) {
		return fmt.Errorf("echoed bytes differ from sent")
	}
	return nil
}

// smallEchoes sends n 16-byte messages on c, one at a time, and returns the
// sorted round-trip times. It stops at the first error.
func smallEchoes(c net.Conn, n int, seq uint64) ([]time.Duration, error) {
	out := make([]time.Duration, 0, n)
	var msg, got [16]byte
	for i := range n {
		binary.BigEndian.PutUint64(msg[:8], seq)
		binary.BigEndian.PutUint64(msg[8:], uint64(i))
		if err := c.SetDeadline(time.Now().Add(echoTimeout)); err != nil {
			return sortDur(out), err
		}
		t0 := time.Now()
		if _, err := c.Write(msg[:]); err != nil {
			return sortDur(out), fmt.Errorf("echo %d write: %w", i, err)
		}
		if _, err := io.ReadFull(c, got[:]); err != nil {
			return sortDur(out), fmt.Errorf("echo %d read: %w", i, err)
		}
		out = append(out, time.Since(t0))
		if got != msg {
			return sortDur(out), fmt.Errorf("echo %d: got %x, want %x", i, got, msg)
		}
	}
	return sortDur(out), c.SetDeadline(time.Time{})
}

// openIdle opens n tunnels to the echo destination (par at a time), checks
// each with a one-byte echo and returns them open.
func openIdle(ctx context.Context, dial dialer, target string, n, par int) ([]net.Conn, int, error) {
	conns := make([]net.Conn, n)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		errs     int
		firstErr error
		next     atomic.Int64
	)
	for range par {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n || ctx.Err() != nil {
					return
				}
				c, err := dial(ctx, target)
				if err == nil {
					err = c.SetDeadline(time.Now().Add(echoTimeout))
					if err == nil {
						var b = [1]byte{byte(i)}
						if _, err = c.Write(b[:]); err == nil {
							if _, err = io.ReadFull(c, b[:]); err == nil && b[0] != byte(i) {
								err = fmt.Errorf("echo got %#x want %#x", b[0], byte(i))
							}
						}
					}
					if err == nil {
						err = c.SetDeadline(time.Time{})
					}
					if err != nil {
						c.Close()
					}
				}
				if err != nil {
					mu.Lock()
					errs++
					if firstErr == nil {
						firstErr = fmt.Errorf("tunnel %d: %w", i, err)
					}
					mu.Unlock()
					continue
				}
				conns[i] = c
			}
		}()
	}
	wg.Wait()
	open := conns[:0]
	for _, c := range conns {
		if c != nil {
			open = append(open, c)
		}
	}
	return open, errs, firstErr
}

func closeAll(conns []net.Conn) {
	for _, c := range conns {
		c.Close()
	}
}
