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
// 32 KiB HTTP/2 DATA frame is three TLS records, and three writes per frame
// were the largest single cost on the byte path.
type recordBatcher struct {
	net.Conn
	mu    sync.Mutex
	depth int
	buf   []byte
}

func (b *recordBatcher) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.depth > 0 {
		b.buf = append(b.buf, p...)
		if len(b.buf) >= batchFlushAt { // keep the buffer small: send a full batch now
			_, err := b.Conn.Write(b.buf)
			b.buf = b.buf[:0]
			if err != nil {
				return 0, err
			}
		}
		return len(p), nil
	}
	return b.Conn.Write(p)
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
	if len(b.buf) == 0 {
		return nil
	}
	_, err := b.Conn.Write(b.buf)
	b.buf = b.buf[:0]
	return err
}

// batchFlushAt bounds a batch: large enough to carry a DATA frame's
// records in one write, small enough not to matter per connection.
const batchFlushAt = 64 << 10

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
