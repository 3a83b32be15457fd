package tunnel

import (
	"bufio"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
	"golang.org/x/sys/unix"
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

	mu      sync.Mutex // a leaf
	closed  bool       // guarded by mu
	closeFn func()     // guarded by mu; run once, outside it
	readErr error      // guarded by mu: the first read error seen before the close: why the peer went away
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

// closeWriter ends the sending half while the receiving half goes on:
// *net.TCPConn, *net.UnixConn and *tls.Conn, and the link's responses (a
// response can end while its request is still read).
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
	return errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE) ||
		errors.Is(err, unix.ENOBUFS) || errors.Is(err, unix.ENOMEM) ||
		errors.Is(err, unix.ECONNABORTED) || errors.Is(err, unix.EINTR)
}

// tlsClient and tlsServer wrap raw in TLS whose records leave in one
// system call per write (see h2link.Batcher).
func tlsClient(raw net.Conn, cfg *tls.Config) *h2link.BatchedTLS { return h2link.TLSClient(raw, cfg) }

func tlsServer(raw net.Conn, cfg *tls.Config) *h2link.BatchedTLS { return h2link.TLSServer(raw, cfg) }

// batcherOf finds the batcher under one of this package's connections,
// for h2link.Config.Batch; nil if there is none.
func batcherOf(c net.Conn) *h2link.Batcher {
	switch c := c.(type) {
	case *watchedConn:
		return batcherOf(c.Conn)
	case *bufferedConn:
		return batcherOf(c.Conn)
	case *h2link.BatchedTLS:
		return c.Batcher()
	case *h2link.Batcher:
		return c
	}
	return nil
}

// defaultDuration sets *d to v when it is zero or negative.
func defaultDuration(d *time.Duration, v time.Duration) {
	if *d <= 0 {
		*d = v
	}
}

// dupSocket returns a second connection on c's socket (a plain TCP or Unix
// socket), with close-on-exec set: closing either leaves the other working.
func dupSocket(c net.Conn) (net.Conn, error) {
	f, err := dupSocketFile(c)
	if err != nil {
		return nil, err
	}
	defer f.Close() // FileConn holds its own duplicate
	return net.FileConn(f)
}

// dupSocketFile duplicates c's descriptor, close-on-exec set.
func dupSocketFile(c net.Conn) (*os.File, error) {
	raw := rawSocket(c)
	if raw == nil {
		return nil, errors.New("not a plain socket")
	}
	fd := -1
	var dupErr error
	if err := raw.Control(func(s uintptr) { fd, dupErr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 3) }); err != nil {
		return nil, err
	}
	if dupErr != nil {
		return nil, os.NewSyscallError("fcntl", dupErr)
	}
	return os.NewFile(uintptr(fd), "tunnel"), nil
}
