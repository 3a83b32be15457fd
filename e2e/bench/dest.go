package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

const (
	chunkSize = 256 << 10 // read/write unit for bulk transfers
	// patternPeriod is deliberately not a power of two, so a reordered or
	// repeated chunk changes the checksum.
	patternPeriod = 1<<20 + 13
	// destIdle bounds how long a destination waits for the next byte. Idle
	// tunnels are held open for RSS measurements, so it is generous; the
	// bench closes every connection when it ends.
	destIdle = 10 * time.Minute
	// ioIdle bounds every bulk read or write: no progress for this long is
	// an error.
	ioIdle = 60 * time.Second
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// pattern is the deterministic byte stream every bulk transfer carries:
// stream offset i holds buf[i % patternPeriod].
type pattern struct {
	buf []byte // patternPeriod bytes plus chunkSize repeated, so any window is contiguous

	mu   sync.Mutex
	crcs map[int64]uint32
}

func newPattern() *pattern {
	r := rand.New(rand.NewChaCha8([32]byte{'k', 'o', 'n', 'n'}))
	buf := make([]byte, patternPeriod+chunkSize)
	for i := 0; i < patternPeriod; i += 8 {
		binary.LittleEndian.PutUint64(buf[i:], r.Uint64()) // may spill into the tail; overwritten next
	}
	copy(buf[patternPeriod:], buf[:chunkSize])
	return &pattern{buf: buf, crcs: map[int64]uint32{}}
}

// window returns the n ≤ chunkSize bytes at stream offset off.
func (p *pattern) window(off int64, n int) []byte {
	o := int(off % patternPeriod)
	return p.buf[o : o+n]
}

// crc is the CRC-32C of the first n bytes of the stream (cached).
func (p *pattern) crc(n int64) uint32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c, ok := p.crcs[n]; ok {
		return c
	}
	var c uint32
	for off := int64(0); off < n; {
		k := int(min(int64(chunkSize), n-off))
		c = crc32.Update(c, castagnoli, p.window(off, k))
		off += int64(k)
	}
	p.crcs[n] = c
	return c
}

// writePattern writes the first n bytes of the stream to c, each chunk under
// a write deadline; sent counts progress.
func (p *pattern) writePattern(c net.Conn, n int64, sent *atomic.Int64) error {
	for off := int64(0); off < n; {
		k := int(min(int64(chunkSize), n-off))
		if err := c.SetWriteDeadline(time.Now().Add(ioIdle)); err != nil {
			return err
		}
		w, err := c.Write(p.window(off, k))
		off += int64(w)
		if sent != nil {
			sent.Add(int64(w))
		}
		if err != nil {
			return fmt.Errorf("write at offset %d: %w", off, err)
		}
	}
	return nil
}

// readCRC reads exactly n bytes from c, each read under a deadline, and
// returns their CRC-32C.
func readCRC(c net.Conn, n int64, buf []byte) (uint32, error) {
	var crc uint32
	for got := int64(0); got < n; {
		if err := c.SetReadDeadline(time.Now().Add(ioIdle)); err != nil {
			return 0, err
		}
		k := int(min(int64(len(buf)), n-got))
		r, err := c.Read(buf[:k])
		crc = crc32.Update(crc, castagnoli, buf[:r])
		got += int64(r)
		if err != nil {
			return 0, fmt.Errorf("read at offset %d of %d: %w", got, n, err)
		}
	}
	return crc, nil
}

// destination is the loopback service behind the tunnel, with one listener
// per behaviour so that the direct and tunnelled paths are byte-identical:
//
//	echo:   returns every byte it reads
//	sink:   reads an 8-byte big-endian length n, then n bytes; answers their 4-byte CRC-32C
//	source: reads an 8-byte length n, then writes n bytes of the pattern
//	hold:   like sink, but reads nothing past the length until released
type destination struct {
	pat                        *pattern
	echo, sink, source, hold   net.Listener
	release                    chan struct{} // closed by releaseHold
	releaseOnce                sync.Once
	sourceSent, holdHeaderSeen atomic.Int64

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
	errs   atomic.Int64 // handler errors other than the peer going away
	errMu  sync.Mutex
	errOne error
}

func startDestination(pat *pattern) (*destination, error) {
	d := &destination{pat: pat, release: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	var err error
	listen := func() net.Listener {
		if err != nil {
			return nil
		}
		var l net.Listener
		l, err = net.Listen("tcp", "127.0.0.1:0")
		return l
	}
	d.echo, d.sink, d.source, d.hold = listen(), listen(), listen(), listen()
	if err != nil {
		d.close()
		return nil, fmt.Errorf("destination listen: %w", err)
	}
	for _, s := range []struct {
		l net.Listener
		h func(net.Conn) error
	}{{d.echo, d.serveEcho}, {d.sink, d.serveSink}, {d.source, d.serveSource}, {d.hold, d.serveHold}} {
		d.wg.Add(1)
		go d.acceptLoop(s.l, s.h)
	}
	return d, nil
}

func (d *destination) releaseHold() { d.releaseOnce.Do(func() { close(d.release) }) }

func (d *destination) acceptLoop(l net.Listener, h func(net.Conn) error) {
	defer d.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// EMFILE and friends: a dead accept loop would leave dials
			// completed in the backlog but never served, so keep going.
			d.fail(fmt.Errorf("accept: %w", err))
			time.Sleep(backoff)
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		d.mu.Lock()
		if d.closed {
			d.mu.Unlock()
			c.Close()
			return
		}
		d.conns[c] = struct{}{}
		d.wg.Add(1)
		d.mu.Unlock()
		go func() {
			defer d.wg.Done()
			if err := h(c); err != nil && !isPeerGone(err) {
				d.fail(err)
			}
			c.Close()
			d.mu.Lock()
			delete(d.conns, c)
			d.mu.Unlock()
		}()
	}
}

// isPeerGone reports the errors a destination sees when the client (or the
// agent on its behalf) closes first, which the bench does on purpose.
func isPeerGone(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE)
}

func (d *destination) fail(err error) {
	d.errs.Add(1)
	d.errMu.Lock()
	if d.errOne == nil {
		d.errOne = err
	}
	d.errMu.Unlock()
}

func (d *destination) firstErr() error {
	d.errMu.Lock()
	defer d.errMu.Unlock()
	return d.errOne
}

func (d *destination) close() {
	d.mu.Lock()
	d.closed = true
	for c := range d.conns {
		c.Close()
	}
	d.mu.Unlock()
	for _, l := range []net.Listener{d.echo, d.sink, d.source, d.hold} {
		if l != nil {
			l.Close()
		}
	}
	d.releaseHold()
	d.wg.Wait()
}

func (d *destination) serveEcho(c net.Conn) error {
	buf := make([]byte, 64<<10)
	for {
		if err := c.SetReadDeadline(time.Now().Add(destIdle)); err != nil {
			return err
		}
		n, err := c.Read(buf)
		if n > 0 {
			if werr := c.SetWriteDeadline(time.Now().Add(ioIdle)); werr != nil {
				return werr
			}
			if _, werr := c.Write(buf[:n]); werr != nil {
				return fmt.Errorf("echo write: %w", werr)
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("echo read: %w", err)
		}
	}
}

func readLength(c net.Conn) (int64, error) {
	var h [8]byte
	if err := c.SetReadDeadline(time.Now().Add(destIdle)); err != nil {
		return 0, err
	}
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return 0, fmt.Errorf("read length: %w", err)
	}
	n := int64(binary.BigEndian.Uint64(h[:]))
	if n < 0 {
		return 0, fmt.Errorf("bad length %d", n)
	}
	return n, nil
}

func (d *destination) serveSink(c net.Conn) error {
	n, err := readLength(c)
	if err != nil {
		return err
	}
	return d.sinkBody(c, n)
}

func (d *destination) sinkBody(c net.Conn, n int64) error {
	crc, err := readCRC(c, n, make([]byte, chunkSize))
	if err != nil {
		return fmt.Errorf("sink: %w", err)
	}
	var out [4]byte
	binary.BigEndian.PutUint32(out[:], crc)
	if err := c.SetWriteDeadline(time.Now().Add(ioIdle)); err != nil {
		return err
	}
	if _, err := c.Write(out[:]); err != nil {
		return fmt.Errorf("sink: write crc: %w", err)
	}
	// Wait for the client to close, so the CRC is not raced by a reset.
	_ = c.SetReadDeadline(time.Now().Add(ioIdle))
	_, _ = c.Read(out[:1])
	return nil
}

func (d *destination) serveSource(c net.Conn) error {
	n, err := readLength(c)
	if err != nil {
		return err
	}
	if err := d.pat.writePattern(c, n, &d.sourceSent); err != nil {
		return fmt.Errorf("source: %w", err)
	}
	_ = c.SetReadDeadline(time.Now().Add(ioIdle))
	var b [1]byte
	_, _ = c.Read(b[:])
	return nil
}

func (d *destination) serveHold(c net.Conn) error {
	n, err := readLength(c)
	if err != nil {
		return err
	}
	d.holdHeaderSeen.Add(1)
	select {
	case <-d.release:
	case <-time.After(destIdle):
		return errors.New("hold: never released")
	}
	return d.sinkBody(c, n)
}
