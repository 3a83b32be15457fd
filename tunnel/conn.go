package tunnel

import (
	"bufio"
	"errors"
	"net"
	"sync"
	"syscall"
)

// bufferedConn reads through a bufio.Reader that may already hold bytes that
// arrived behind a handshake, so none of them is lost when HTTP/2 takes over.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// watchedConn closes done when the connection is closed by anyone, which is
// how the server learns that the HTTP/2 client connection to an agent ended.
type watchedConn struct {
	net.Conn
	once sync.Once
	done chan struct{}
}

func newWatchedConn(c net.Conn) *watchedConn {
	return &watchedConn{Conn: c, done: make(chan struct{})}
}

func (c *watchedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { close(c.done) })
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
