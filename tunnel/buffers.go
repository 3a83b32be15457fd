package tunnel

import (
	"errors"
	"io"
	"net/http"
	"sync"
)

// copyBufSize is the size of one read on the byte path. Buffers come from a
// pool and go back as soon as the copy ends.
const copyBufSize = 32 << 10

// bufPool is immutable after init (a sync.Pool is safe for concurrent use).
var bufPool = sync.Pool{New: func() any { b := make([]byte, copyBufSize); return &b }}

// copyStream copies src to dst until src ends. A nil error means src ended
// cleanly (io.EOF). When flush is non-nil it is called after every write, so
// interactive streams (exec, logs -f) see bytes at once.
func copyStream(dst io.Writer, src io.Reader, flush func()) (written int64, err error) {
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
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
