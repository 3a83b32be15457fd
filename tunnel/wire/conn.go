package wire

import (
	"bufio"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// BufferedConn reads through a bufio.Reader that may already hold bytes that
// arrived behind a handshake, so none of them is lost when HTTP/2 takes over.
type BufferedConn struct {
	net.Conn
	R *bufio.Reader
}

func (c *BufferedConn) Read(p []byte) (int, error) { return c.R.Read(p) }

// WatchedConn runs a function when the connection is closed by anyone,
// which is how the server learns that the HTTP/2 client connection to an
// agent ended.
type WatchedConn struct {
	net.Conn

	Mu      sync.Mutex // a leaf
	closed  bool       // guarded by mu
	closeFn func()     // guarded by mu; run once, outside it
	ReadErr error      // guarded by mu: the first read error seen before the close: why the peer went away
}

func (c *WatchedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		c.Mu.Lock()
		if c.ReadErr == nil && !c.closed {
			c.ReadErr = err
		}
		c.Mu.Unlock()
	}
	return n, err
}

// CloseReason says why the connection ended, for the log line.
func (c *WatchedConn) CloseReason() string {
	c.Mu.Lock()
	defer c.Mu.Unlock()
	switch {
	case c.ReadErr == nil || errors.Is(c.ReadErr, net.ErrClosed):
		return "closed here (after the peer's GOAWAY, on shutdown, when replaced by a newer connection, or with no answer to PING)"
	case errors.Is(c.ReadErr, io.EOF):
		return "the peer closed the connection"
	default:
		return c.ReadErr.Error()
	}
}

func NewWatchedConn(c net.Conn) *WatchedConn {
	return &WatchedConn{Conn: c}
}

// OnClose runs f once the connection is closed (at once if it already is).
func (c *WatchedConn) OnClose(f func()) {
	c.Mu.Lock()
	if c.closed {
		c.Mu.Unlock()
		f()
		return
	}
	c.closeFn = f
	c.Mu.Unlock()
}

func (c *WatchedConn) Close() error {
	c.Mu.Lock()
	f := c.closeFn
	first := !c.closed
	c.closed, c.closeFn = true, nil // before the close: a read it fails is not the peer's doing
	c.Mu.Unlock()
	err := c.Conn.Close()
	if first && f != nil {
		f()
	}
	return err
}

// CloseWriter ends the sending half while the receiving half goes on:
// *net.TCPConn, *net.UnixConn and *tls.Conn, and the link's responses (a
// response can end while its request is still read).
type CloseWriter interface{ CloseWrite() error }

func CloseWrite(c net.Conn) error {
	if cw, ok := c.(CloseWriter); ok {
		return cw.CloseWrite()
	}
	return c.Close()
}

// IsTemporaryAccept reports accept errors worth retrying: running out of
// file descriptors or buffers, or a peer that left before we accepted it.
func IsTemporaryAccept(err error) bool {
	return errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE) ||
		errors.Is(err, unix.ENOBUFS) || errors.Is(err, unix.ENOMEM) ||
		errors.Is(err, unix.ECONNABORTED) || errors.Is(err, unix.EINTR)
}

// TlsClient and TlsServer wrap raw in TLS whose records leave in one
// system call per write (see h2link.Batcher).
func TlsClient(raw net.Conn, cfg *tls.Config) *h2link.BatchedTLS { return h2link.TLSClient(raw, cfg) }

func TlsServer(raw net.Conn, cfg *tls.Config) *h2link.BatchedTLS { return h2link.TLSServer(raw, cfg) }

// BatcherOf finds the batcher under one of this package's connections,
// for h2link.Config.Batch; nil if there is none.
func BatcherOf(c net.Conn) *h2link.Batcher {
	switch c := c.(type) {
	case *WatchedConn:
		return BatcherOf(c.Conn)
	case *BufferedConn:
		return BatcherOf(c.Conn)
	case *h2link.BatchedTLS:
		return c.Batcher()
	case *h2link.Batcher:
		return c
	}
	return nil
}

// DefaultDuration sets *d to v when it is zero or negative.
func DefaultDuration(d *time.Duration, v time.Duration) {
	if *d <= 0 {
		*d = v
	}
}

// DupSocket returns a second connection on c's socket (a plain TCP or Unix
// socket), with close-on-exec set: the other works on when either is closed.
func DupSocket(c net.Conn) (net.Conn, error) {
	f, err := DupSocketFile(c)
	if err != nil {
		return nil, err
	}
	defer f.Close() // FileConn holds its own duplicate
	return net.FileConn(f)
}

// DupSocketFile duplicates c's descriptor, close-on-exec set.
func DupSocketFile(c net.Conn) (*os.File, error) {
	raw := RawSocket(c)
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
