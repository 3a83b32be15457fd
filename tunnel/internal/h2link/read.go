package h2link

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"golang.org/x/net/http2"
)

// The read loop is the only reader of the connection. It never waits for
// a write: what it must send goes through the control queue.

func (l *Conn) readLoop() {
	defer close(l.readerDone)
	defer l.flushers.Wait() // after closeWith: no flusher starts any more
	for {
		if l.ctlOverflow.Load() {
			l.goAwayClose(http2.ErrCodeEnhanceYourCalm, fmt.Errorf("%w: more than %d control frames queued for a peer that does not read", errCalm, l.cfg.MaxQueuedControl))
			return
		}
		f, err := l.fr.ReadFrame()
		if err == nil {
			l.lastRead.Store(time.Now().UnixNano())
			err = l.handle(f)
		}
		if err == nil {
			continue
		}
		var se http2.StreamError
		if errors.As(err, &se) {
			l.streamError(se)
			continue
		}
		if errors.Is(err, errCalm) {
			l.goAwayClose(http2.ErrCodeEnhanceYourCalm, err)
			return
		}
		var ce http2.ConnectionError
		if errors.As(err, &ce) {
			l.goAwayClose(http2.ErrCode(ce), err)
			return
		}
		if errors.Is(err, http2.ErrFrameTooLarge) {
			l.goAwayClose(http2.ErrCodeFrameSize, err)
			return
		}
		if errors.Is(err, errStopRead) {
			// Stopped for a freeze: the connection is Freeze's or Close's.
			close(l.readParked)
			<-l.frozen
			return
		}
		l.closeWith(err)
		return
	}
}

// goAwayClose ends the connection for a connection error: GOAWAY with
// code, after the control frames already queued, unless the write lock or
// the write takes longer than goAwayWait (a peer that does not read);
// then close. Only the read loop calls it.
func (l *Conn) goAwayClose(code http2.ErrCode, err error) {
	l.mu.Lock()
	l.goAway = true
	l.capacityChangedLocked()
	last := l.lastPeerID
	l.mu.Unlock()
	written := make(chan struct{})
	go func() { // waited for below: the close ends its write
		defer close(written)
		l.wmu.Lock()
		defer l.wmu.Unlock()
		l.conn.SetWriteDeadline(time.Now().Add(goAwayWait))
		if l.ctlOverflow.Load() || l.flushControlWLocked() == nil {
			l.fr.WriteGoAway(last, code, nil)
		}
	}()
	t := time.NewTimer(goAwayWait)
	select {
	case <-written:
	case <-t.C:
	}
	t.Stop()
	l.closeWith(err)
	<-written
}

// goAwayWait bounds the wait to tell a failing peer why.
const goAwayWait = time.Second

// streamError answers a frame that is an error for one stream only
// (RFC 9113 §5.4.2): RST_STREAM, and the stream, if open, ends.
func (l *Conn) streamError(se http2.StreamError) {
	l.mu.Lock()
	st := l.streams[se.StreamID]
	if st == nil && l.serving && l.idleLocked(se.StreamID) && se.StreamID%2 == 1 {
		l.lastPeerID = se.StreamID // a refused HEADERS still opened (and closed) its stream
	}
	l.mu.Unlock()
	err := fmt.Errorf("%w: %v", ErrStreamReset, se)
	if st != nil && st.reset(se.Code, err) {
		return
	}
	// Not open, or closed meanwhile: the peer is told all the same.
	id, code := se.StreamID, se.Code
	l.writeControl(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, code) })
}

// idleLocked reports whether stream id was never opened (RFC 9113 §5.1:
// "idle"); the caller holds mu. Neither end opens even streams: the
// client end opens odd ones, and push is off.
func (l *Conn) idleLocked(id uint32) bool {
	if id%2 == 0 {
		return true
	}
	if l.serving {
		return id > l.lastPeerID
	}
	return id >= l.nextID
}

func (l *Conn) handle(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.DataFrame:
		return l.onData(f)
	case *http2.MetaHeadersFrame:
		return l.onHeaders(f)
	case *http2.RSTStreamFrame:
		return l.onRSTStream(f)
	case *http2.SettingsFrame:
		if f.IsAck() {
			return nil
		}
		if err := l.applySettings(f); err != nil {
			return err
		}
		l.writeControl(func(fr *http2.Framer) error { return fr.WriteSettingsAck() })
	case *http2.PingFrame:
		if !f.IsAck() {
			data := f.Data
			l.writeControl(func(fr *http2.Framer) error { return fr.WritePing(true, data) })
			return nil
		}
		l.mu.Lock()
		if f.Data == bdpPingData {
			l.bdpAckLocked(time.Now())
		} else if l.pingOut && f.Data == l.pingData {
			l.pingOut = false
			if l.pingTimer != nil {
				l.pingTimer.Reset(l.cfg.KeepAlive)
			}
		}
		l.mu.Unlock()
	case *http2.GoAwayFrame:
		l.onGoAway(f)
	case *http2.WindowUpdateFrame:
		return l.onWindowUpdate(f)
	case *http2.PriorityFrame:
		if f.StreamDep == f.StreamID {
			// §5.3.1: a stream cannot depend on itself. Answered here, not
			// through streamError: PRIORITY does not open an idle stream.
			l.mu.Lock()
			st := l.streams[f.StreamID]
			l.mu.Unlock()
			if st == nil || !st.reset(http2.ErrCodeProtocol, fmt.Errorf("%w: depends on itself", ErrStreamReset)) {
				id := f.StreamID
				l.writeControl(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeProtocol) })
			}
		}
	case *http2.PushPromiseFrame:
		return http2.ConnectionError(http2.ErrCodeProtocol) // push is disabled
	}
	return nil // unknown frames are ignored, priorities too
}

func (l *Conn) applySettings(f *http2.SettingsFrame) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return f.ForeachSetting(func(s http2.Setting) error {
		if err := s.Valid(); err != nil {
			return err
		}
		switch s.ID {
		case http2.SettingMaxFrameSize:
			l.peerMaxFrame = s.Val
		case http2.SettingMaxConcurrentStreams:
			l.peerMaxStreams = s.Val
			l.capacityChangedLocked()
		case http2.SettingInitialWindowSize:
			delta := int64(s.Val) - int64(l.peerWindow)
			l.peerWindow = int32(s.Val)
			for _, st := range l.streams {
				if !st.sendWindow.add(delta) {
					return flowError(0) // §6.9.2: a window past 2^31-1 is a connection error
				}
			}
			l.wakeEverySenderLocked()
		case http2.SettingEnablePush:
			if !l.serving && s.Val != 0 {
				return http2.ConnectionError(http2.ErrCodeProtocol) // only a client may send it
			}
		}
		return nil
	})
}

func (l *Conn) onGoAway(f *http2.GoAwayFrame) {
	l.mu.Lock()
	l.goAway = true
	l.peerWhy = peerDebug(f.DebugData())
	l.capacityChangedLocked()
	// The last stream ID counts streams this end opened; on the serving
	// end the peer opened them all, and they go on.
	var refused []*stream
	for id, st := range l.streams {
		if !l.serving && id > f.LastStreamID {
			refused = append(refused, st)
		}
	}
	l.idleChanLocked(len(refused))
	l.mu.Unlock()
	for _, st := range refused {
		st.fail(ErrGoAway) // never seen by the peer: safe to retry elsewhere
	}
}

func (l *Conn) onWindowUpdate(f *http2.WindowUpdateFrame) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	inc := int64(f.Increment)
	if f.StreamID == 0 {
		if !l.sendWindow.add(inc) {
			return flowError(0)
		}
		l.sendPeak = max(l.sendPeak, l.sendWindow.avail())
		l.wakeSendersLocked()
	} else if st := l.streams[f.StreamID]; st != nil {
		if !st.sendWindow.add(inc) {
			return flowError(f.StreamID)
		}
		st.sendCond.Broadcast()
	} else if l.idleLocked(f.StreamID) {
		return http2.ConnectionError(http2.ErrCodeProtocol) // §5.1: only HEADERS or PRIORITY on an idle stream
	} else {
		return nil // a closed stream: updates may still be in flight
	}
	return nil
}

func (l *Conn) onRSTStream(f *http2.RSTStreamFrame) error {
	l.mu.Lock()
	st := l.streams[f.StreamID]
	idle := st == nil && l.idleLocked(f.StreamID)
	l.mu.Unlock()
	switch {
	case st != nil:
		if st.resetByPeer(f.ErrCode) {
			return fmt.Errorf("%w: more than %d streams reset by the peer while their handlers ran (rapid reset)", errCalm, l.cfg.MaxPeerResets)
		}
	case idle:
		return http2.ConnectionError(http2.ErrCodeProtocol)
	}
	return nil
}

// Connection credit goes back in two ways. Each WINDOW_UPDATE of a
// stream carries the connection's credit pending then (streamCredit), in
// the same write, so a link whose streams are read as they arrive sends
// no update of its own for the connection. Alone, it goes back once a
// quarter of the window is pending (refillAt): the connection window
// bounds the bytes in flight (bdp.go), and a quarter not yet returned is what
// the window's doubling makes up for; a finer share costs a system call
// at each end for every few DATA frames of a fast link.
func refillAt(target int32) int64 { return max(int64(target)/4, 1) }

// takeConnCreditLocked takes the pending connection credit to return, if
// it is at least least; the caller holds mu and sends the WINDOW_UPDATE.
func (l *Conn) takeConnCreditLocked(least int64) int64 {
	n := l.recvUnacked
	if n <= 0 || n < least {
		return 0
	}
	l.recvUnacked = 0
	l.recvWindow.add(n)
	return n
}

// streamCredit is the control frame returning n bytes of a stream's
// credit, and with it the connection's credit pending when it is written
// (it runs under wmu, which comes before mu).
func (l *Conn) streamCredit(id, n uint32) func(*http2.Framer) error {
	return func(fr *http2.Framer) error {
		if err := fr.WriteWindowUpdate(id, n); err != nil {
			return err
		}
		l.mu.Lock()
		c := l.takeConnCreditLocked(1)
		l.mu.Unlock()
		if c == 0 {
			return nil
		}
		return fr.WriteWindowUpdate(0, uint32(c))
	}
}

func (l *Conn) onData(f *http2.DataFrame) error {
	id := f.StreamID
	n := int64(f.Header().Length) // flow control counts padding too
	l.mu.Lock()
	l.recvWindow.take(n)
	if l.recvWindow.avail() < 0 {
		l.mu.Unlock()
		return flowError(0)
	}
	// Connection credit goes back as it arrives (the stream windows are
	// what bound the memory a peer can fill), as much as keeps the peer's
	// window at recvTarget (bdp.go).
	measure := l.bdpDataLocked(n, time.Now())
	l.recvUnacked += n
	refill := l.takeConnCreditLocked(refillAt(l.recvTarget))
	st := l.streams[id]
	var state streamState
	if st != nil {
		state = st.state
	}
	idle := st == nil && l.idleLocked(id)
	l.mu.Unlock()
	if refill > 0 {
		l.writeControl(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, uint32(refill)) })
	}
	if measure {
		l.sendBDPPing()
	}
	switch {
	case idle:
		return http2.ConnectionError(http2.ErrCodeProtocol)
	case st == nil && l.serving:
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeStreamClosed}
	case st == nil:
		return nil // a stream this end reset: what was in flight is dropped
	case state == stateHalfClosedRemote:
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeStreamClosed}
	}
	if err := st.receive(f.Data(), n); err != nil {
		var se http2.StreamError
		if errors.As(err, &se) {
			st.reset(se.Code, fmt.Errorf("%w: %v", ErrStreamReset, err))
		} else {
			st.reset(http2.ErrCodeProtocol, err)
		}
		return nil
	}
	if f.StreamEnded() {
		st.endRecv()
	}
	return nil
}

func (l *Conn) onHeaders(f *http2.MetaHeadersFrame) error {
	if f.Truncated {
		// Past MaxHeaderListSize (far past it closes the connection in the
		// framer): refuse this stream, keep the connection.
		l.mu.Lock()
		st := l.streams[f.StreamID]
		l.mu.Unlock()
		if st != nil {
			st.reset(http2.ErrCodeProtocol, fmt.Errorf("%w: header list too large", ErrStreamReset))
			return nil
		}
		return http2.StreamError{StreamID: f.StreamID, Code: http2.ErrCodeRefusedStream}
	}
	if l.serving {
		return l.onRequest(f)
	}
	return l.onResponse(f)
}

func (l *Conn) onResponse(f *http2.MetaHeadersFrame) error {
	l.mu.Lock()
	st := l.streams[f.StreamID]
	idle := st == nil && l.idleLocked(f.StreamID)
	l.mu.Unlock()
	if idle {
		return http2.ConnectionError(http2.ErrCodeProtocol) // no stream this end opened
	}
	if st == nil {
		return nil // a stream we already ended
	}
	st.rmu.Lock()
	answered := st.answeredRLocked() || st.respErr != nil
	st.rmu.Unlock()
	if answered {
		// Trailers, or an answer to a stream already failed: only
		// END_STREAM matters here.
		if f.StreamEnded() {
			st.endRecv()
		}
		return nil
	}
	code, err := strconv.Atoi(f.PseudoValue("status"))
	if err != nil || code < 200 {
		if err == nil && code >= 100 {
			return nil // an informational answer; the final one follows
		}
		st.reset(http2.ErrCodeProtocol, fmt.Errorf("%w: bad :status %q", ErrStreamReset, f.PseudoValue("status")))
		return nil
	}
	header := make(http.Header, len(f.RegularFields()))
	for _, hf := range f.RegularFields() {
		header.Add(hf.Name, hf.Value)
	}
	st.rmu.Lock()
	if st.respErr == nil { // else the stream failed meanwhile and respReady is closed
		st.resp = &http.Response{
			StatusCode: code, Status: strconv.Itoa(code) + " " + http.StatusText(code),
			Proto: "HTTP/2.0", ProtoMajor: 2, Header: header, Body: &Body{st: st},
		}
		close(st.respReady)
	}
	st.rmu.Unlock()
	if f.StreamEnded() {
		st.endRecv()
	}
	return nil
}
