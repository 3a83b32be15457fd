package wire

import (
	"log/slog"
	"net/http"
	"runtime/debug"

	"github.com/spinifex/konnectivity/internal/promtext"
)

// RecoverTunnelPanic, deferred in a per-tunnel goroutine, keeps a bug in
// one tunnel's code from taking down every other tunnel: a panic is
// recovered, logged once with its stack, counted, and ends only that
// tunnel. http.ErrAbortHandler, the HTTP/2 server's way to reset a stream,
// is not a bug and goes on; with resetStream (a stream handler's goroutine)
// every panic ends as that reset, so the peer sees the stream reset.
func RecoverTunnelPanic(log *slog.Logger, counter *promtext.Counter, where string, resetStream bool) {
	e := recover()
	if e == nil {
		return
	}
	if e != http.ErrAbortHandler {
		counter.Inc()
		log.Error("panic recovered; only this tunnel is affected", "where", where, "panic", e, "stack", string(debug.Stack()))
	}
	if e == http.ErrAbortHandler || resetStream {
		panic(http.ErrAbortHandler)
	}
}
