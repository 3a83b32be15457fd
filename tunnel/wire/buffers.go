package wire

import (
	"errors"
	"io"
	"net/http"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// Copy buffers come in two sizes. A tunnel starts with a small one, which
// is what an idle tunnel holds while it waits for bytes; a read that fills
// it switches to a large one for bulk transfer, and a short read switches
// back. Buffers return to their pool when the copy ends.
const (
	SmallBufSize = 4 << 10
	LargeBufSize = 128 << 10
)

// The pools are immutable after init (a sync.Pool is safe for concurrent use).
var (
	smallBufs = sync.Pool{New: func() any { b := make([]byte, SmallBufSize); return &b }}
	LargeBufs = sync.Pool{New: func() any { b := make([]byte, LargeBufSize); return &b }}
)

// CopyStream copies src to dst until src ends. A nil error means src ended
// cleanly (io.EOF). When flush is non-nil it is called after every write, so
// interactive streams (exec, logs -f) see bytes at once.
func CopyStream(dst io.Writer, src io.Reader, flush func()) (written int64, err error) {
	if body, ok := src.(*h2link.Body); ok && flush == nil {
		return body.WriteTo(dst) // no buffer of our own: the received chunks are written
	}
	if rc := RawSocket(src); rc != nil {
		return CopyFromSocket(dst, rc, flush)
	}
	return copyBuffered(dst, src, flush)
}

// copyBuffered is CopyStream for any other source: through a pooled buffer
// that grows while reads fill it. Its own function: its frame is not on
// the parked path of a socket's tunnel (see "Parked stacks" in doc.go).
func copyBuffered(dst io.Writer, src io.Reader, flush func()) (written int64, err error) {
	small := smallBufs.Get().(*[]byte)
	defer smallBufs.Put(small)
	var large *[]byte
	defer func() {
		if large != nil {
			LargeBufs.Put(large)
		}
	}()
	buf := *small
	for {
		n, rerr := src.Read(buf)
		if n > 0 {
			w, werr := dst.Write(buf[:n])
			written += int64(w)
			if werr != nil {
				return written, werr
			}
			if flush != nil {
				flush()
			}
		}
		switch {
		case n == len(buf) && large == nil:
			large = LargeBufs.Get().(*[]byte)
			buf = *large
		case n < SmallBufSize && large != nil:
			LargeBufs.Put(large)
			large, buf = nil, *small
		}
		if rerr != nil {
			if errors.Is(rerr, io.EOF) {
				return written, nil
			}
			return written, rerr
		}
	}
}

func FlusherOf(w http.ResponseWriter) func() {
	if f, ok := w.(http.Flusher); ok {
		return f.Flush
	}
	return nil
}

// RawSocket returns the raw connection of a plain TCP or Unix socket, for
// CopyFromSocket; nil for anything else (TLS, pipes, HTTP bodies).
func RawSocket(r io.Reader) syscall.RawConn { return h2link.RawSocket(r) }

// CopyFromSocket is CopyStream for a socket source. It takes a buffer only
// once the socket has bytes: a read that would block puts the buffer back
// before it waits, so a quiet tunnel holds none. It makes the same system
// calls as net.Conn.Read (a read, and on EAGAIN a wait in the poller).
func CopyFromSocket(dst io.Writer, rc syscall.RawConn, flush func()) (written int64, err error) {
	size := SmallBufSize
	for {
		var buf *[]byte
		var n int
		var rerr error
		err := rc.Read(func(fd uintptr) bool {
			buf = GetBuf(size)
			for {
				n, rerr = unix.Read(int(fd), *buf)
				if rerr != unix.EINTR {
					break
				}
			}
			if rerr == unix.EAGAIN {
				PutBuf(buf)
				buf = nil
				return false // wait for the socket without the buffer
			}
			return true
		})
		if err != nil { // closed, or a deadline
			if buf != nil {
				PutBuf(buf)
			}
			return written, err
		}
		if rerr != nil {
			PutBuf(buf)
			return written, os.NewSyscallError("read", rerr)
		}
		if n == 0 {
			PutBuf(buf)
			return written, nil // end of stream
		}
		w, werr := dst.Write((*buf)[:n])
		written += int64(w)
		if werr == nil && flush != nil {
			flush()
		}
		full := n == len(*buf)
		PutBuf(buf)
		if werr != nil {
			return written, werr
		}
		switch {
		case full:
			size = LargeBufSize // bulk: read more at once
		case n < SmallBufSize:
			size = SmallBufSize
		}
	}
}

func GetBuf(size int) *[]byte {
	if size == LargeBufSize {
		return LargeBufs.Get().(*[]byte)
	}
	return smallBufs.Get().(*[]byte)
}

func PutBuf(b *[]byte) {
	if len(*b) == LargeBufSize {
		LargeBufs.Put(b)
		return
	}
	smallBufs.Put(b)
}
