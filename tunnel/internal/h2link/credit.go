package h2link

// Send credit: who may take the connection's send window, and who is
// woken when credit comes. Thousands of streams may wait for the one
// connection window at once; which of them goes next is decided here, in
// the order they asked, never by which goroutine the scheduler runs first.
//
// The rules, each enforced under Conn.mu:
//
//   - A stream's writer waits on its own sendCond, for one of two things.
//     With no credit of its own stream (sendWindow empty) it waits outside
//     any queue: that stream's WINDOW_UPDATE, a SETTINGS change, the
//     stream's end or the connection's wakes it. With credit of its own
//     but none of the connection's for it, or with others waiting for the
//     connection's ahead of it, it waits in the connection's send queue.
//   - The send queue is first come, first served, in two classes: small
//     writes (at most smallWrite, which may spend the share bulk writes
//     spare for them: connAvailLocked) ahead of bulk ones. A writer takes
//     connection credit only from the head of its class's queue, or when
//     its class has no queue; a bulk writer also lets every small one go
//     first. A writer that took credit and has more to send asks again at
//     the tail, so bulk streams share the window in turn.
//   - Whoever changes what the head may take wakes the head: connection
//     credit arriving (a WINDOW_UPDATE of stream 0), and a writer leaving
//     the queue (served with credit left over, its stream out of credit,
//     or its stream or connection ended). So a head whose class has
//     credit is always awake or about to be: connection credit never sits
//     unused while a writer that could use it waits, and no writer is
//     passed over by one that asked later.
//
// One sendCond per stream means a WINDOW_UPDATE wakes the one writer it
// is for, not every writer on the connection.

// sendClass is a writer's class in the send queue.
type sendClass uint8

const (
	sendSmall sendClass = iota // at most smallWrite bytes: goes first
	sendBulk
)

func classOf(bulk bool) sendClass {
	if bulk {
		return sendBulk
	}
	return sendSmall
}

// sendQueue is one class of streams whose writers wait for connection
// credit, oldest first, linked through the streams. Under Conn.mu.
type sendQueue struct{ head, tail *stream }

// mayTakeLocked reports whether st's writer, about to send a write of
// class c, may take send credit now. When it may not, st is where its
// writer waits (in the send queue, or out of it for its own credit) and
// the caller waits on st.sendCond. The caller holds Conn.mu.
func (st *stream) mayTakeLocked(c sendClass) bool {
	l := st.l
	if st.sendWindow.avail() <= 0 {
		l.leaveSendQueueLocked(st) // it waits for its own credit: the next in line goes
		return false
	}
	if l.connAvailLocked(c == sendBulk) > 0 && l.firstInLineLocked(st, c) {
		return true
	}
	l.joinSendQueueLocked(st, c)
	return false
}

// firstInLineLocked reports whether no writer waits for connection credit
// ahead of st's write of class c. The caller holds Conn.mu.
func (l *Conn) firstInLineLocked(st *stream, c sendClass) bool {
	if c == sendBulk && l.sendQ[sendSmall].head != nil {
		return false
	}
	h := l.sendQ[c].head
	return h == nil || h == st
}

// joinSendQueueLocked puts st at the tail of class c's queue, unless it
// is queued already. The caller holds Conn.mu.
func (l *Conn) joinSendQueueLocked(st *stream, c sendClass) {
	if st.inSendQueue {
		return
	}
	q := &l.sendQ[c]
	st.inSendQueue, st.sendClass = true, c
	st.sendPrev, st.sendNext = q.tail, nil
	if q.tail != nil {
		q.tail.sendNext = st
	} else {
		q.head = st
	}
	q.tail = st
}

// leaveSendQueueLocked takes st out of the send queue, if it is in it,
// and wakes whoever is first in line now. The caller holds Conn.mu.
func (l *Conn) leaveSendQueueLocked(st *stream) {
	if !st.inSendQueue {
		return
	}
	q := &l.sendQ[st.sendClass]
	if st.sendPrev != nil {
		st.sendPrev.sendNext = st.sendNext
	} else {
		q.head = st.sendNext
	}
	if st.sendNext != nil {
		st.sendNext.sendPrev = st.sendPrev
	} else {
		q.tail = st.sendPrev
	}
	st.sendPrev, st.sendNext, st.inSendQueue = nil, nil, false
	l.wakeSendersLocked()
}

// wakeSendersLocked wakes the writer first in line for connection credit
// when there is credit for it: the head of the small writes, else the
// head of the bulk ones. The caller holds Conn.mu.
func (l *Conn) wakeSendersLocked() {
	if h := l.sendQ[sendSmall].head; h != nil {
		if l.connAvailLocked(false) > 0 {
			h.sendCond.Broadcast()
		}
		return
	}
	if h := l.sendQ[sendBulk].head; h != nil && l.connAvailLocked(true) > 0 {
		h.sendCond.Broadcast()
	}
}

// wakeEverySenderLocked wakes every writer: the connection ended, or a
// SETTINGS change moved every stream's window. The caller holds Conn.mu.
func (l *Conn) wakeEverySenderLocked() {
	for _, st := range l.streams {
		st.sendCond.Broadcast()
	}
}
