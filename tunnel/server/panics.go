package server

import (
	"log/slog"
	"net/http"
	"runtime/debug"

	"github.com/spinifex/konnectivity/internal/promtext"
)

// A bug in one tunnel's code must not take down every other tunnel: a
// panic in a per-tunnel goroutine is recovered, logged once with its stack,
// counted, and ends only that tunnel.
func recoverTunnelPanic(log *slog.Logger, counter *promtext.Counter, where string) {
	e := recover()
	if e == nil {
		return
	}
	if e == http.ErrAbortHandler {
		panic(e) // the HTTP/2 server's way to reset a stream, not a bug
	}
	counter.Inc()
	log.Error("panic recovered; only this tunnel is affected", "where", where, "panic", e, "stack", string(debug.Stack()))
}
