package h2link

import "golang.org/x/net/http2"

// window is one flow-control window (RFC 9113 §6.9): the bytes of DATA
// that may still be sent, or that the peer may still send. It may go
// negative when SETTINGS_INITIAL_WINDOW_SIZE shrinks (§6.9.2); it may never
// exceed 2^31-1. Its guard is that of the field holding it.
type window struct{ n int64 }

// avail is what may be sent now; zero or less means wait.
func (w *window) avail() int64 { return w.n }

// take spends n bytes of the window.
func (w *window) take(n int64) { w.n -= n }

// add grows the window by n and reports whether it stayed within 2^31-1;
// a window past it stays unchanged.
func (w *window) add(n int64) bool {
	if w.n+n > maxWindow {
		return false
	}
	w.n += n
	return true
}

// flowError is the error a window overflow is (RFC 9113 §6.9.1): a stream
// error for a stream's window, a connection error for the connection's.
func flowError(id uint32) error {
	if id == 0 {
		return http2.ConnectionError(http2.ErrCodeFlowControl)
	}
	return http2.StreamError{StreamID: id, Code: http2.ErrCodeFlowControl}
}
