package h2link

import (
	"context"
	"net/http"
	"sync/atomic"
	"time"
)

// Sizes fixed by this implementation.
const (
	// MaxFrameSize is the largest frame payload either end sends or
	// accepts: a 64 KiB DATA frame is one copy buffer's worth, sent in one
	// system call.
	MaxFrameSize = 64 << 10

	// DefaultStreamWindow is the receive window a stream starts with and
	// the least it gets: 1 MiB keeps loopback and LAN streams at full
	// speed (window/RTT) through a busy machine's pauses. A long link's
	// streams get more (bdp.go). It bounds what one stalled tunnel holds.
	DefaultStreamWindow = 1 << 20

	// DefaultConnWindow is the most the connection's receive window
	// grows to. Connection credit is returned as frames arrive (the
	// stream windows are what bound memory), so the window bounds the
	// bytes on their way; it follows the link (bdp.go).
	DefaultConnWindow = 1 << 30

	// maxWindow is the largest flow-control window RFC 9113 §6.9.1 allows.
	maxWindow = 1<<31 - 1

	// initialWindow and initialFrame are the HTTP/2 defaults that hold
	// until the peer's SETTINGS.
	initialWindow = 65535
	initialFrame  = 16 << 10
)

// Config is the behaviour of one connection: every limit and default of
// the link is here. The zero value of a field takes the default named on it.
type Config struct {
	// KeepAlive sends a PING once nothing was read for this long; a PING
	// that gets no answer within PingTimeout closes the connection. Zero
	// sends none. Their sum also bounds a write that makes no progress, and
	// on the serving end the wait for the client preface.
	KeepAlive   time.Duration
	PingTimeout time.Duration

	// StallAfter marks a connection stalled when one write has been under
	// way this long (a peer that does not read): it takes no new stream
	// (CanTakeNewRequest), and a RoundTrip waiting to write its headers
	// gives up with ErrStalled. Default DefaultStallAfter; negative: never.
	StallAfter time.Duration

	// CreditStallAfter is how long writers may wait for connection credit
	// while none of them is served, or this end may owe the peer credit
	// for bytes its reader consumed, before the link counts a credit stall
	// (stall.go). Default DefaultCreditStallAfter; negative: never.
	CreditStallAfter time.Duration

	// OnCreditStall, when set, is told of each credit stall once, when a
	// check sees it (stall.go). It runs on the checking goroutine (the
	// keepalive timer's, or a caller of CheckCredit) outside the link's
	// locks; it must not block or call the link.
	OnCreditStall func(CreditStall)

	// MaxConcurrentStreams is, on the serving end, how many streams the
	// peer may have at once (SETTINGS_MAX_CONCURRENT_STREAMS). A stream
	// counts until both its halves ended and its handler returned, so a
	// peer that resets streams cannot run more handlers than this.
	// Default 100.
	MaxConcurrentStreams uint32

	// StreamWindow is the least receive window this end gives a stream,
	// and ConnWindow the most it gives the connection; between them the
	// windows follow the link (bdp.go). Defaults DefaultStreamWindow and
	// DefaultConnWindow; at most 2^31-1.
	StreamWindow int32
	ConnWindow   int32

	// PreAdmitStreamWindow and PreAdmitConnWindow, when set on a serving
	// end, are the windows it starts with instead: what a peer that has
	// not logged in yet may make this end hold. The owner calls
	// (*Conn).RaiseWindows once it has admitted the peer, which raises
	// them to StreamWindow and the window that follows the link.
	PreAdmitStreamWindow int32
	PreAdmitConnWindow   int32

	// Queued, when set, counts the received bytes queued in this link's
	// streams and not yet read or written on (a reader that does not
	// keep up holds up to its stream's window here); links may share one,
	// for a bound across them.
	Queued *atomic.Int64

	// MaxQueuedControl bounds the control frames (SETTINGS and PING
	// acknowledgements, WINDOW_UPDATE, RST_STREAM) waiting for a peer that
	// does not read; past it the connection is closed (ENHANCE_YOUR_CALM).
	// Default 10,000, as x/net/http2.
	MaxQueuedControl int

	// MaxHeaderListSize bounds a received header block, decoded. A stream
	// whose block is larger is refused; the connection stays. Default 64 KiB.
	MaxHeaderListSize uint32

	// MaxPeerResets bounds, on the serving end, the streams the peer may
	// reset before they were answered while their handler still runs (and
	// the streams it opens past MaxConcurrentStreams), beyond the ones it
	// let finish: each takes one from a budget of this size; each handler
	// that finishes without a reset, and each second, give one back. A peer
	// that empties it (rapid reset) gets GOAWAY ENHANCE_YOUR_CALM and is
	// dropped. Tunnels reset after their answer cost nothing. Default 1000.
	MaxPeerResets int

	// BaseContext is the parent of every handler's request context on the
	// serving end. Default context.Background().
	BaseContext context.Context

	// Take, when set on a serving end, chooses who serves each stream the
	// peer opens, in place of NewServer's handler: the read loop asks it
	// once the stream passed the link's own checks, before anything runs
	// for it, and a nil answer refuses the stream with REFUSED_STREAM
	// (RFC 9113 §8.7: not processed, so the peer may send it again,
	// elsewhere). A handler it returns always runs, so an owner that
	// counts its streams in Take, and ends the count when the handler
	// returns, never counts one that is not served, and sees each from
	// the moment the link took it. It is called under Conn.mu: it must not
	// block, call the link, or take any lock but a leaf.
	Take func(r *http.Request) http.Handler

	// Spawn runs an owned goroutine (the read loop on the client end,
	// handlers, socket writers). Default: go f().
	Spawn func(f func())

	// Freezable makes a serving end able to stop, freeze and be rebuilt
	// in another process on the same socket (freeze.go). It costs a little
	// on every read.
	Freezable bool

	// Batch, when set, gathers the records of one write into one system
	// call: the Batcher under the connection's TLS, or one wrapping a
	// plain socket. Nil writes through the connection as it is.
	Batch *Batcher

	// Prelude, on a client end, is sent just before the HTTP/2 client
	// preface: the HTTP/1.1 answer that upgrades the connection. With
	// Batch, prelude, preface and settings leave in one system call.
	Prelude []byte
}

// Defaults of Config.
const (
	DefaultMaxConcurrentStreams = 100
	DefaultMaxQueuedControl     = 10000
	DefaultMaxHeaderListSize    = 64 << 10
	DefaultMaxPeerResets        = 1000
	// DefaultStallAfter is long enough for a write of two full frames
	// over a link of 256 kbit/s.
	DefaultStallAfter = 5 * time.Second
)

// withDefaults returns c with every unset field at its default.
func (c Config) withDefaults() Config {
	if c.StallAfter == 0 {
		c.StallAfter = DefaultStallAfter
	}
	if c.CreditStallAfter == 0 {
		c.CreditStallAfter = DefaultCreditStallAfter
	}
	if c.MaxConcurrentStreams == 0 {
		c.MaxConcurrentStreams = DefaultMaxConcurrentStreams
	}
	if c.StreamWindow <= 0 {
		c.StreamWindow = DefaultStreamWindow
	}
	if c.ConnWindow <= 0 {
		c.ConnWindow = DefaultConnWindow
	}
	if c.PreAdmitStreamWindow <= 0 || c.PreAdmitStreamWindow > c.StreamWindow {
		c.PreAdmitStreamWindow = c.StreamWindow
	}
	if c.PreAdmitConnWindow <= 0 || c.PreAdmitConnWindow > c.ConnWindow {
		c.PreAdmitConnWindow = c.ConnWindow
	}
	// A connection window starts at 65,535 and can only be raised.
	c.ConnWindow = max(c.ConnWindow, initialWindow)
	c.PreAdmitConnWindow = max(c.PreAdmitConnWindow, initialWindow)
	if c.MaxQueuedControl <= 0 {
		c.MaxQueuedControl = DefaultMaxQueuedControl
	}
	if c.MaxHeaderListSize == 0 {
		c.MaxHeaderListSize = DefaultMaxHeaderListSize
	}
	if c.MaxPeerResets <= 0 {
		c.MaxPeerResets = DefaultMaxPeerResets
	}
	if c.BaseContext == nil {
		c.BaseContext = context.Background()
	}
	if c.Spawn == nil {
		c.Spawn = func(f func()) { go f() }
	}
	return c
}
