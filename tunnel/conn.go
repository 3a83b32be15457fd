package tunnel

import (
	"bufio"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
	"time"
)

// bufferedConn reads through a bufio.Reader that may already hold bytes that
// arrived behind a handshake, so none of them is lost when HTTP/2 takes over.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// watchedConn runs a function when the connection is closed by anyone,
// which is how the server learns that the HTTP/2 client connection to an
// agent ended.
type watchedConn struct {
	net.Conn
	mu      sync.Mutex
	closed  bool
	closeFn func()
	readErr error // the first read error seen before the close: why the peer went away
}

func (c *watchedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		c.mu.Lock()
		if c.readErr == nil && !c.closed {
			c.readErr = err
		}
		c.mu.Unlock()
	}
	return n, err
}

// closeReason says why the connection ended, for the log line.
func (c *watchedConn) closeReason() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.readErr == nil || errors.Is(c.readErr, net.ErrClosed):
		return "closed here (after the peer's GOAWAY, on shutdown, when replaced by a newer connection, or with no answer to PING)"
	case errors.Is(c.readErr, io.EOF):
		return "the peer closed the connection"
	default:
		return c.readErr.Error()
	}
}

func newWatchedConn(c net.Conn) *watchedConn {
	return &watchedConn{Conn: c}
}

// onClose runs f once the connection is closed (at once if it already is).
func (c *watchedConn) onClose(f func()) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		f()
		return
	}
	c.closeFn = f
	c.mu.Unlock()
}

func (c *watchedConn) Close() error {
	c.mu.Lock()
	f := c.closeFn
	first := !c.closed
	c.closed, c.closeFn = true, nil // before the close: a read it fails is not the peer's doing
	c.mu.Unlock()
	err := c.Conn.Close()
	if first && f != nil {
		f()
	}
	return err
}

// closeWriter is implemented by *net.TCPConn, *net.UnixConn and *tls.Conn.
type closeWriter interface{ CloseWrite() error }

func closeWrite(c net.Conn) error {
	if cw, ok := c.(closeWriter); ok {
		return cw.CloseWrite()
	}
	return c.Close()
}

// isTemporaryAccept reports accept errors worth retrying: running out of
// file descriptors or buffers, or a peer that left before we accepted it.
func isTemporaryAccept(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM) ||
		errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.EINTR)
}

// recordBatcher sits under TLS and, while a write is in progress above it,
// gathers the records TLS produces so they leave in one system call: a
// 64 KiB HTTP/2 DATA frame is five TLS records, and a write per record was
// the largest single cost on the byte path. The batch buffer comes from a
// pool and goes back after each write, so an idle connection holds none.
type recordBatcher struct {
	net.Conn
	mu    sync.Mutex
	depth int
	buf   *[]byte // nil outside a batch
}

var batchBufs = sync.Pool{New: func() any { b := make([]byte, 0, batchFlushAt+tlsRecordMax); return &b }}

func (b *recordBatcher) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.depth == 0 {
		return b.Conn.Write(p)
	}
	if b.buf == nil {
		b.buf = batchBufs.Get().(*[]byte)
	}
	*b.buf = append(*b.buf, p...)
	if len(*b.buf) >= batchFlushAt { // keep the batch bounded: send it now
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// flushLocked writes the batch and returns its buffer to the pool.
func (b *recordBatcher) flushLocked() error {
	if b.buf == nil {
		return nil
	}
	var err error
	if len(*b.buf) > 0 {
		_, err = b.Conn.Write(*b.buf)
	}
	*b.buf = (*b.buf)[:0]
	batchBufs.Put(b.buf)
	b.buf = nil
	return err
}

func (b *recordBatcher) begin() {
	b.mu.Lock()
	b.depth++
	b.mu.Unlock()
}

// end sends what was gathered. It holds the lock while writing so records
// from a concurrent writer cannot overtake them.
func (b *recordBatcher) end() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.depth--
	if b.depth > 0 {
		return nil
	}
	return b.flushLocked()
}

// batchFlushAt bounds a batch: two whole DATA frames of maxFrameSize (what
// one large copy buffer holds) with their headers and the TLS overhead of
// their records fit, so they leave in one write.
const (
	batchFlushAt = 2*maxFrameSize + 4<<10
	tlsRecordMax = 16<<10 + 256 // a record's plaintext limit plus its overhead
)

// batchedTLS is a TLS connection whose writes go out in one system call.
type batchedTLS struct {
	*tls.Conn
	raw *recordBatcher
}

func (c *batchedTLS) Write(p []byte) (int, error) {
	c.raw.begin()
	n, err := c.Conn.Write(p)
	if ferr := c.raw.end(); err == nil && ferr != nil {
		err = ferr
	}
	return n, err
}

// tlsClient and tlsServer wrap raw in TLS with batched record writes.
func tlsClient(raw net.Conn, cfg *tls.Config) *batchedTLS {
	b := &recordBatcher{Conn: raw}
	return &batchedTLS{Conn: tls.Client(b, cfg), raw: b}
}

func tlsServer(raw net.Conn, cfg *tls.Config) *batchedTLS {
	b := &recordBatcher{Conn: raw}
	return &batchedTLS{Conn: tls.Server(b, cfg), raw: b}
}

// defaultDuration sets *d to v when it is zero or negative.
func defaultDuration(d *time.Duration, v time.Duration) {
	if *d <= 0 {
		*d = v
	}
}
