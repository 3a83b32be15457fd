package h2link

import (
	"crypto/rand"
	"time"

	"golang.org/x/net/http2"
)

// Probe asks a quiet peer for a sign of life: when nothing was read since
// since, it sends a PING now, and the connection closes, as when a
// keepalive PING goes unanswered, unless within wait the answer comes or
// anything else is read (a busy peer may answer a PING late, but a frame
// proves it is there). A PING already out keeps its payload; its deadline
// only moves closer. A caller waiting on a stream that the peer does not
// answer so learns in wait, not in KeepAlive + PingTimeout, whether the
// peer is there: its stream fails with ErrClosed once the connection
// closes. Probe does nothing on a connection without KeepAlive (no PING
// timer) or once closed, and returns at once.
func (l *Conn) Probe(since time.Time, wait time.Duration) {
	l.mu.Lock()
	if l.closed || l.pingTimer == nil || l.lastRead.Load() > since.UnixNano() {
		l.mu.Unlock()
		return
	}
	due := time.Now().Add(wait)
	if l.pingOut {
		if due.Before(l.pingDue) {
			l.pingDue = due
			l.probeSent = time.Now()
			l.pingTimer.Reset(wait)
		}
		l.mu.Unlock()
		return
	}
	l.pingOut = true
	rand.Read(l.pingData[:])
	data := l.pingData
	l.pingDue = due
	l.probeSent = time.Now()
	l.pingTimer.Reset(wait)
	l.mu.Unlock()
	l.writeControl(func(fr *http2.Framer) error { return fr.WritePing(false, data) })
}

// probeAnswered reports whether the outstanding PING is a probe's and
// something was read since it went out; the caller holds mu.
func (l *Conn) probeAnswered() bool {
	return !l.probeSent.IsZero() && l.lastRead.Load() > l.probeSent.UnixNano()
}

// maxPeerDebug bounds what this end keeps of the peer's GOAWAY debug data.
const maxPeerDebug = 256

// peerDebug is what PeerGoAwayDebug keeps of a GOAWAY's debug data.
func peerDebug(b []byte) string {
	return string(b[:min(len(b), maxPeerDebug)])
}

// SetGoAwayDebug sets the debug data of the GOAWAY this end sends next
// (Shutdown, GoAwayNow): why the connection ends, for a peer that acts on
// it. It is meant for this end's owner and its peer: RFC 9113 §6.8 lets
// no one else rely on it.
func (l *Conn) SetGoAwayDebug(why string) {
	l.mu.Lock()
	l.goAwayWhy = []byte(why)
	l.mu.Unlock()
}

// PeerGoAwayDebug is the debug data of the GOAWAY the peer sent (its
// first maxPeerDebug bytes), or "" if it sent none.
func (l *Conn) PeerGoAwayDebug() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.peerWhy
}
