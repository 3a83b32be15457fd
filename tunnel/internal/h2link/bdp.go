package h2link

import (
	"math"
	"time"

	"golang.org/x/net/http2"
)

// The receive windows follow the link, as the receiving end measures it
// (the way gRPC estimates a bandwidth-delay product): with the first DATA
// after the last measurement this end sends a PING, counts the bytes that
// arrive until its acknowledgement, and so learns the round trip and what
// the link delivered in it.
//
// The connection window bounds the bytes on their way: its credit goes
// back as frames arrive, not as they are read, so it is what the link
// holds in flight and in its queues. It stays near what the link needs
// to stay full, plus queueTarget of queue:
//   - a round trip longer than the shortest seen plus the target, at the
//     link's full speed (at least three quarters of the fastest it went
//     lately, as trips that carried 256 KiB or more tell): bytes wait in
//     a queue of this end's making; the window comes down to what the
//     link delivered per that shortest trip plus the target, at most
//     halving. A trip made long by a busy machine (the speed fell with
//     it) is no such queue, nor is one during which this end sent bulk
//     too: its round trip waited behind this end's own bytes, whose queue
//     the peer's window governs;
//   - a round trip that brought in two thirds of the window or more, with
//     no queue (no longer than the shortest plus half the target) or at a
//     new fastest speed: the window was the limit; it doubles (a long link
//     reaches its speed in a few trips);
//   - anything else changes nothing.
//
// A smaller window is given back by returning less credit, never by
// taking any back (RFC 9113 §6.9). A stream's window is twice what the
// link delivers at its fastest in its shortest round trip, between Config.StreamWindow
// and maxStreamWindow, so that one stream can fill a long link; it bounds
// what a stalled reader holds. It moves as the stream's credit goes back
// (refillRLocked), so a quiet stream costs nothing when the link's speed
// changes.
//
// The shortest round trip is the least seen on the connection; a minute
// in which every trip took longer than it by more than the target (the
// path itself got longer) replaces it with that minute's least.
const (
	queueTarget     = 5 * time.Millisecond
	minConnWindow   = 32 << 10
	startConnWindow = 1 << 20
	maxStreamWindow = 16 << 20
	maxAutoWindow   = 64 << 20
	bdpPingGap      = 20 * time.Millisecond // at most one measurement this often
	rttEpoch        = time.Minute
	rateHalfLife    = 500 * time.Millisecond
	rateSample      = 256 << 10 // the least a trip carries for its speed to count
)

// bdpPingData marks this end's measuring PING.
var bdpPingData = [8]byte{'h', '2', 'l', 'i', 'n', 'k', 'b', 'w'}

// bdpEstimator is the measurement of one connection's link; under Conn.mu.
type bdpEstimator struct {
	on       bool          // the windows follow the link (after admission, on a serving end that has one)
	out      bool          // a measuring PING is on its way
	sent     time.Time     // when it was queued
	acked    time.Time     // when the last one was answered
	bytes    int64         // DATA bytes received since it was queued
	wrote    int64         // DATA bytes this end sent meanwhile
	minRTT   time.Duration // the shortest round trip (0: none yet)
	epochMin time.Duration // the shortest in this epoch
	epoch    time.Time     // when this epoch began
	maxRate  float64       // bytes per second: the fastest the link went lately
	rateAt   time.Time     // when maxRate was last updated
}

// bdpDataLocked counts n bytes of DATA received and, if none is on its
// way, starts a measurement; the caller holds mu and sends the PING when
// start is set.
func (l *Conn) bdpDataLocked(n int64, now time.Time) (start bool) {
	b := &l.bdp
	if !b.on {
		return false
	}
	if b.out {
		b.bytes += n
		return false
	}
	if now.Sub(b.acked) < bdpPingGap {
		return false
	}
	b.out, b.sent, b.bytes, b.wrote = true, now, n, 0
	return true
}

// bdpAckLocked takes the answer to a measuring PING and sets the windows;
// the caller holds mu.
func (l *Conn) bdpAckLocked(now time.Time) {
	b := &l.bdp
	if !b.out {
		return
	}
	b.out, b.acked = false, now
	rtt := max(now.Sub(b.sent), time.Microsecond)
	if b.minRTT == 0 || rtt < b.minRTT {
		b.minRTT = rtt
	}
	if b.epoch.IsZero() || now.Sub(b.epoch) > rttEpoch {
		if b.epochMin > b.minRTT+queueTarget {
			b.minRTT = b.epochMin // the path itself got longer
		}
		b.epoch, b.epochMin = now, rtt
	} else {
		b.epochMin = min(b.epochMin, rtt)
	}
	rate := float64(b.bytes) / rtt.Seconds() // what the link delivered
	// The fastest the link went lately, from trips that carried enough to
	// say (a shaper's bucket lets a few frames through at any speed); it
	// halves every rateHalfLife.
	b.maxRate *= math.Exp2(-float64(now.Sub(b.rateAt)) / float64(rateHalfLife))
	b.rateAt = now
	sure := b.bytes >= rateSample
	if sure {
		b.maxRate = max(b.maxRate, rate)
	}
	cur := int64(l.recvTarget)
	next := cur
	// A trip during which this end sent bulk too measured the queue of
	// its own bytes on their way to the peer as well, which this window
	// does not govern: the peer's does. Left to it, each end shrinks its
	// window for the other's queue, and both collapse.
	twoWay := b.wrote >= max(b.bytes/4, minConnWindow)
	switch limit := b.minRTT + queueTarget; {
	case rtt > limit && rate >= 0.75*b.maxRate && !twoWay:
		// A queue at the link's full speed: of this end's making.
		next = max(int64(rate*limit.Seconds()), cur/2)
	case 3*b.bytes >= 2*cur && (rtt <= b.minRTT+queueTarget/2 || sure && rate >= b.maxRate):
		next = 2 * cur
	}
	l.setRecvTargetLocked(next)
	stream := int64(2 * b.maxRate * b.minRTT.Seconds())
	l.streamTarget.Store(int32(min(max(stream, int64(l.cfg.StreamWindow)), maxStreamWindow)))
}

// setRecvTargetLocked moves the connection window this end gives toward
// n, within its bounds: more credit goes back with the next refill, or
// less until the peer's window is down to it. The caller holds mu.
func (l *Conn) setRecvTargetLocked(n int64) {
	n = min(max(n, minConnWindow), int64(l.cfg.ConnWindow), maxAutoWindow)
	cur := int64(l.recvTarget)
	if n == cur {
		return
	}
	l.recvUnacked += n - cur
	l.recvTarget = int32(n)
}

// sendBDPPing queues the measuring PING.
func (l *Conn) sendBDPPing() {
	l.writeControl(func(fr *http2.Framer) error { return fr.WritePing(false, bdpPingData) })
}
