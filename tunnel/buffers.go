package tunnel

import (
	"errors"
	"io"
	"net/http"
	"sync"
)

// Copy buffers come in two sizes. A tunnel starts with a small one, which
// is what an idle tunnel holds while it waits for bytes; a read that fills
// it switches to a large one for bulk transfer, and a short read switches
// back. Buffers return to their pool when the copy ends.
const (
	smallBufSize = 4 << 10
	largeBufSize = 128 << 10
)

// The pools are immutable after init (a sync.Pool is safe for concurrent use).
var (
	smallBufs = sync.Pool{New: func() any { b := make([]byte, smallBufSize); return &b }}
	largeBufs = sync.Pool{New: func() any { b := make([]byte, largeBufSize); return &b }}
)

// copyStream copies src to dst until src ends. A nil error means src ended
// cleanly (io.EOF). When flush is non-nil it is called after every write, so
// interactive streams (exec, logs -f) see bytes at once.
func copyStream(dst io.Writer, src io.Reader, flush func()) (written int64, err error) {
	small := smallBufs.Get().(*[]byte)
	defer smallBufs.Put(small)
	var large *[]byte
	defer func() {
		if large != nil {
			largeBufs.Put(large)
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
			large = largeBufs.Get().(*[]byte)
			buf = *large
		case n < smallBufSize && large != nil:
			largeBufs.Put(large)
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

func flusherOf(w http.ResponseWriter) func() {
	if f, ok := w.(http.Flusher); ok {
		return f.Flush
	}
	return nil
}
