package h2link

import (
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// A probe of a peer that answers nothing closes the link within the
// probe's wait, long before keepalive and PING timeout would.
func TestLinkProbeClosesSilentLink(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, time.Minute, time.Minute)
	a.synced() // from here the fake agent sends and answers nothing
	start := time.Now()
	l.Probe(start, 200*time.Millisecond)
	waitLinkEnded(t, l, "a probed link whose peer answers nothing still open after 5s")
	if took := time.Since(start); took < 200*time.Millisecond {
		t.Fatalf("closed after %v, before the probe's wait", took)
	}
}

// A probe of a peer that answers the PING keeps the link; a probe of a
// link that read a frame since the given time sends no PING at all.
func TestLinkProbeAnsweredKeepsLink(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, time.Minute, time.Minute)
	a.synced()
	since := time.Now()
	l.Probe(since, 300*time.Millisecond)
	f := a.nextPing()
	if err := a.fr.WritePing(true, f.Data); err != nil {
		t.Fatal(err)
	}
	// Three probe waits: the answered PING must have stopped the close.
	time.Sleep(900 * time.Millisecond)
	if !l.CanTakeNewRequest() {
		t.Fatal("a link whose probe was answered was closed")
	}
	// The answer was read after since: a probe sends nothing more.
	l.Probe(since, 300*time.Millisecond)
	a.fr.WritePing(false, [8]byte{9}) // its answer comes after any PING the probe sent
	if f := a.nextPing(); !f.IsAck() || f.Data != [8]byte{9} {
		t.Fatalf("a probe of a link that read since sent a PING %v", f.Data)
	}
}

// A busy peer may answer a probe's PING late: any frame it sends within
// the probe's wait shows it is there, and the link stays.
func TestLinkProbeAnyFrameKeepsLink(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, time.Minute, time.Minute)
	a.synced()
	l.Probe(time.Now(), 300*time.Millisecond)
	a.nextPing() // not answered
	if err := a.fr.WriteWindowUpdate(0, 1); err != nil {
		t.Fatal(err)
	}
	time.Sleep(900 * time.Millisecond) // three probe waits
	if !l.CanTakeNewRequest() {
		t.Fatal("a probed link whose peer sent a frame was closed")
	}
}

// synced returns once the link has read every frame the fake agent sent
// so far: the answer to a PING sent after them has come back.
func (a *fakeAgent) synced() {
	a.t.Helper()
	mark := [8]byte{'s', 'y', 'n', 'c'}
	if err := a.fr.WritePing(false, mark); err != nil {
		a.t.Fatal(err)
	}
	for p := a.nextPing(); !p.IsAck() || p.Data != mark; p = a.nextPing() {
	}
}

// nextPing returns the next PING frame, an answer or not.
func (a *fakeAgent) nextPing() *http2.PingFrame {
	a.t.Helper()
	for {
		a.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		f, err := a.fr.ReadFrame()
		if err != nil {
			a.t.Fatalf("fake agent read: %v", err)
		}
		if p, ok := f.(*http2.PingFrame); ok {
			return p
		}
	}
}

// The debug data set for this end's GOAWAY reaches the peer, and the
// peer's is kept.
func TestLinkGoAwayDebug(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, time.Minute, time.Minute)
	if err := a.fr.WriteGoAway(0, http2.ErrCodeNo, []byte("peer says why")); err != nil {
		t.Fatal(err)
	}
	l.SetGoAwayDebug("this end says why")
	l.GoAwayNow()
	for {
		f := a.next()
		if g, ok := f.(*http2.GoAwayFrame); ok {
			if string(g.DebugData()) != "this end says why" {
				t.Fatalf("GOAWAY debug data %q", g.DebugData())
			}
			break
		}
	}
	for deadline := time.Now().Add(5 * time.Second); l.PeerGoAwayDebug() != "peer says why"; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("PeerGoAwayDebug %q", l.PeerGoAwayDebug())
		}
	}
}
