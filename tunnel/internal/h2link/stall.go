package h2link

import (
	"slices"
	"time"
)

// Credit stalls: a safety net under the rules of send credit (credit.go)
// and of returning it (refillRLocked, refillAt). Those rules mean that a
// writer never waits for credit its peer has had the means to return; a
// credit lost on some path breaks that, and a tunnel then hangs while
// every health signal stays green. Neither end sees the other's
// accounts, so each looks for what its own accounts say can only be a
// lost credit or a link that carries nothing:
//
//   - As a sender, connection credit that does not come. The receiving
//     end returns connection credit as frames arrive, not as they are
//     read (onData), so a writer waits for it only while bytes are on
//     their way, one round trip and the link's queue. The send queue of a
//     class (small or bulk writes) whose head has not changed, and in
//     which no writer was served, for CreditStallAfter is stuck: the
//     peer does not return the credit, the link does not carry the bytes,
//     or a writer was not woken. A writer far back in a long queue whose
//     head moves is not stuck: it waits its turn among many (a few
//     milliseconds a turn), and so is not counted however long that is.
//     A writer that waits for its own stream's credit is not counted
//     either: that is a far reader that does not read (a paused
//     kubectl logs -f), the flow control doing its work.
//   - As a receiver, credit owed. A stream's receive window for the peer
//     plus the credit not yet returned plus the bytes queued for its
//     reader is always its window size (recvSize), and the credit goes
//     back once a quarter of the window is consumed; so a window spent to
//     nothing (recvWindow <= 0) with nothing queued (the reader took it
//     all) cannot last beyond the read that consumed it. Seen on two
//     checks CreditStallAfter apart, the credit is lost. The same holds
//     for the connection: its receive window plus what is not yet
//     returned is recvTarget, returned at refillAt as frames arrive.
//
// The checks run on the keepalive timer (keepAliveTick: every KeepAlive
// on a busy link) and whenever the link's owner asks (CheckCredit: a
// scrape of its metrics, a read of its status), never on a goroutine of
// their own; they sample, so a stall is seen between CreditStallAfter and
// CreditStallAfter plus the time to the next check after it. The data
// path pays for them one integer add under Conn.mu per write, and one
// time.Now per wait for credit, none when no writer waits.
//
// Each stall is told once (Config.OnCreditStall) and counted on the link
// (CheckCredit's Stalls): a stuck queue once for its head, until the
// queue moves; owed credit once per stream, and once for the connection,
// until it is returned.

// DefaultCreditStallAfter is how long connection credit may not come, or
// credit stay owed, before it is a credit stall: far beyond a round trip
// and the link's queue (at the least connection window, 64 KiB, a quarter
// of it comes back every 10 s on a link of 13 kbit/s), and short of what
// an operator calls a hang.
const DefaultCreditStallAfter = 10 * time.Second

// CreditStallKind is what a credit stall is.
type CreditStallKind uint8

const (
	// StallConnectionCredit: writers wait for connection credit, and none
	// of them was served for CreditStallAfter.
	StallConnectionCredit CreditStallKind = iota
	// StallCreditOwed: this end owes the peer credit for bytes its reader
	// consumed, and has not returned it.
	StallCreditOwed
	NumCreditStallKinds
)

var creditStallNames = [NumCreditStallKinds]string{"connection_credit", "credit_owed"}

func (k CreditStallKind) String() string { return creditStallNames[k] }

// CreditStall is one credit stall, with the figures that show it.
type CreditStall struct {
	Kind CreditStallKind
	// StreamID is the stream: the head of the stuck send queue, or the
	// stream that owes credit; 0 for the connection's own credit owed.
	StreamID uint32
	// For is how long the stall has been seen: at least this long.
	For time.Duration

	// Of a stuck send queue (StallConnectionCredit).
	Waited         time.Duration // how long the head's writer has waited for credit
	SendWindow     int64         // the head's stream send window
	ConnSendWindow int64         // the connection's send window
	Writers        int           // writers in the stuck queue

	// Of owed credit (StallCreditOwed).
	RecvWindow int64 // what the peer may still send
	Unacked    int64 // consumed, not returned
	Queued     int64 // received, not yet read (a stream's)
	WindowSize int64 // the window this end gives the stream, or the connection
}

// LogArgs are the stall's figures as slog key-value pairs.
func (s CreditStall) LogArgs() []any {
	args := []any{"kind", s.Kind.String(), "stream", s.StreamID, "for", s.For.Round(time.Millisecond).String()}
	if s.Kind == StallConnectionCredit {
		return append(args, "waited", s.Waited.Round(time.Millisecond).String(), "send_window", s.SendWindow,
			"conn_send_window", s.ConnSendWindow, "writers_waiting", s.Writers)
	}
	return append(args, "recv_window", s.RecvWindow, "unacked", s.Unacked, "queued", s.Queued, "window", s.WindowSize)
}

// SendWait is a writer waiting for send credit.
type SendWait struct {
	StreamID uint32
	Since    time.Time // when it began to wait
	// ForConnection: it waits in the connection's send queue, with credit
	// of its own stream; otherwise it waits for its stream's credit.
	ForConnection bool
}

// CreditStatus is a link's send credit, as a status page shows it.
type CreditStatus struct {
	Stalls  uint64     // credit stalls seen on the link
	Waiting int        // writers waiting for send credit now
	Longest []SendWait // the longest waits, longest first
}

// creditWatch is what the credit checks keep between them; under Conn.mu.
type creditWatch struct {
	// served counts, by class, the writers that went on after asking for
	// send credit (writeData): the send queue's progress.
	served   [2]uint64
	heads    [2]headWatch
	connOwed time.Time // when a check first saw the connection's credit owed; zero while it is not
	connTold bool      // that stall was told
	stalls   uint64    // stalls told
}

// headWatch is a send queue's head as the last check saw it.
type headWatch struct {
	id     uint32    // the head's stream; 0: the queue was empty
	served uint64    // creditWatch.served of its class then
	since  time.Time // when a check first saw this head and count
	told   bool      // its stall was told
}

// waitingLocked notes that st's writer waits for send credit, from now
// unless it was waiting already. The caller holds Conn.mu.
func (st *stream) waitingLocked() {
	if st.waitSince == 0 {
		st.waitSince = time.Now().UnixNano()
	}
}

// goesOnLocked notes that st's writer, a write of class c, stopped
// waiting or never had to. The caller holds Conn.mu.
func (st *stream) goesOnLocked(c sendClass) {
	st.waitSince = 0
	st.l.watch.served[c]++
}

// CheckCredit looks for credit stalls now, tells Config.OnCreditStall of
// those not told yet, and returns the link's credit status with at most
// longest of its longest waits.
func (l *Conn) CheckCredit(longest int) CreditStatus {
	now := time.Now()
	stalls := l.checkCredit(now)
	st := l.creditStatus(now, longest)
	l.tellCreditStalls(stalls)
	return st
}

// checkAndTell runs the checks and tells what they found.
func (l *Conn) checkAndTell(now time.Time) { l.tellCreditStalls(l.checkCredit(now)) }

func (l *Conn) tellCreditStalls(stalls []CreditStall) {
	if f := l.cfg.OnCreditStall; f != nil {
		for _, s := range stalls {
			f(s)
		}
	}
}

// checkCredit runs the checks (see above) and returns the stalls seen
// for the first time. It takes Conn.mu, and each stream's rmu under it.
func (l *Conn) checkCredit(now time.Time) []CreditStall {
	bound := l.cfg.CreditStallAfter
	if bound < 0 {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	var out []CreditStall
	w := &l.watch
	for c := range w.heads {
		h, hw := l.sendQ[c].head, &w.heads[c]
		if h == nil || l.readStopped() { // a freeze stops the reads: credit cannot come
			*hw = headWatch{}
			continue
		}
		if hw.id != h.id || hw.served != w.served[c] {
			*hw = headWatch{id: h.id, served: w.served[c], since: now}
			continue
		}
		if hw.told || now.Sub(hw.since) < bound {
			continue
		}
		hw.told = true
		s := CreditStall{
			Kind: StallConnectionCredit, StreamID: h.id, For: now.Sub(hw.since),
			SendWindow: h.sendWindow.avail(), ConnSendWindow: l.sendWindow.avail(),
		}
		if h.waitSince != 0 {
			s.Waited = now.Sub(time.Unix(0, h.waitSince))
		}
		for q := h; q != nil; q = q.sendNext {
			s.Writers++
		}
		out = append(out, s)
	}
	switch {
	case l.recvWindow.avail() > 0:
		w.connOwed, w.connTold = time.Time{}, false
	case w.connOwed.IsZero():
		w.connOwed = now
	case !w.connTold && now.Sub(w.connOwed) >= bound:
		w.connTold = true
		out = append(out, CreditStall{
			Kind: StallCreditOwed, For: now.Sub(w.connOwed), RecvWindow: l.recvWindow.avail(),
			Unacked: l.recvUnacked, WindowSize: int64(l.recvTarget),
		})
	}
	for _, st := range l.streams {
		st.rmu.Lock()
		if s, ok := st.owedRLocked(now, bound); ok {
			out = append(out, s)
		}
		st.rmu.Unlock()
	}
	w.stalls += uint64(len(out))
	return out
}

// owedRLocked checks the stream for credit owed: its window spent while
// nothing is queued, on a stream still receiving. It reports a stall the
// first time the condition has been true for bound. The caller holds rmu.
func (st *stream) owedRLocked(now time.Time, bound time.Duration) (CreditStall, bool) {
	if st.recvWindow.avail() > 0 || st.queued > 0 || st.eof || st.recvErr != nil || st.readerGone {
		st.owedSince, st.owedTold = 0, false
		return CreditStall{}, false
	}
	if st.owedSince == 0 {
		st.owedSince = now.UnixNano()
		return CreditStall{}, false
	}
	since := time.Unix(0, st.owedSince)
	if st.owedTold || now.Sub(since) < bound {
		return CreditStall{}, false
	}
	st.owedTold = true
	return CreditStall{
		Kind: StallCreditOwed, StreamID: st.id, For: now.Sub(since), RecvWindow: st.recvWindow.avail(),
		Unacked: st.unacked, Queued: st.queued, WindowSize: int64(st.recvSize),
	}, true
}

// creditStatus is CheckCredit's answer.
func (l *Conn) creditStatus(now time.Time, longest int) CreditStatus {
	l.mu.Lock()
	defer l.mu.Unlock()
	cs := CreditStatus{Stalls: l.watch.stalls}
	for _, st := range l.streams {
		if st.waitSince == 0 {
			continue
		}
		cs.Waiting++
		if longest > 0 {
			cs.Longest = append(cs.Longest, SendWait{StreamID: st.id, Since: time.Unix(0, st.waitSince), ForConnection: st.inSendQueue})
		}
	}
	slices.SortFunc(cs.Longest, func(a, b SendWait) int { return a.Since.Compare(b.Since) })
	if len(cs.Longest) > longest {
		cs.Longest = cs.Longest[:longest]
	}
	return cs
}
