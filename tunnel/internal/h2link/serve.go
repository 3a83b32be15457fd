package h2link

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"golang.org/x/net/http2"
)

// --- the serving end ---

// onRequest starts a stream the peer opened, or takes the trailers of one
// it has open. Everything a stream needs is set before it is published in
// l.streams, where closeWith may find it at any time.
func (l *Conn) onRequest(f *http2.MetaHeadersFrame) error {
	id := f.StreamID
	l.mu.Lock()
	if st := l.streams[id]; st != nil {
		state := st.state
		l.mu.Unlock()
		return st.onTrailers(f, state)
	}
	if id%2 == 0 || id <= l.lastPeerID {
		// §5.1.1: a new stream's ID exceeds every earlier one; a closed
		// stream takes no HEADERS either (§5.1).
		l.mu.Unlock()
		return http2.ConnectionError(http2.ErrCodeProtocol)
	}
	l.lastPeerID = id
	refuse, exhausted := false, false
	if l.closed || l.goAway || uint32(l.counted) >= l.cfg.MaxConcurrentStreams {
		refuse = true
		exhausted = !l.closed && !l.goAway && l.chargeResetLocked()
	}
	l.mu.Unlock()
	if exhausted {
		return fmt.Errorf("%w: streams opened past the concurrency limit again and again", errCalm)
	}
	if refuse {
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeRefusedStream}
	}
	if f.HasPriority() && f.Priority.StreamDep == id {
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol} // §5.3.1
	}
	req, declared, err := l.newRequest(f)
	if err != nil {
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol, Cause: err}
	}
	state := stateOpen
	if f.StreamEnded() {
		state = stateHalfClosedRemote
	}
	ctx, cancel := context.WithCancel(l.cfg.BaseContext)
	l.mu.Lock()
	st := newStream(l, id, state)
	l.mu.Unlock()
	st.cancelCtx = cancel
	if declared >= 0 {
		st.clen = &contentLength{declared: declared}
	}
	st.eof = f.StreamEnded()
	if st.eof && declared > 0 {
		cancel()
		return http2.StreamError{StreamID: id, Code: http2.ErrCodeProtocol, Cause: fmt.Errorf("content-length %d without DATA", declared)}
	}
	req.Body = &Body{st: st}
	req = req.WithContext(ctx)

	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		cancel()
		return nil
	}
	h := l.handler
	if l.cfg.Take != nil {
		// Under mu, after the last check that can drop the stream: a
		// handler Take returns is spawned below, whatever comes next.
		if h = l.cfg.Take(req); h == nil {
			l.mu.Unlock()
			cancel()
			return http2.StreamError{StreamID: id, Code: http2.ErrCodeRefusedStream}
		}
	}
	st.handlerRunning = true
	st.counted = true
	l.counted++
	l.streams[id] = st
	l.capacityChangedLocked()
	l.mu.Unlock()
	l.cfg.Spawn(func() { l.runHandler(h, st, req) })
	return nil
}

// onTrailers takes a second header block on an open stream: trailers,
// which must end the stream and carry no pseudo-header (RFC 9113 §8.1).
func (st *stream) onTrailers(f *http2.MetaHeadersFrame, state streamState) error {
	switch {
	case state == stateHalfClosedRemote:
		return http2.StreamError{StreamID: st.id, Code: http2.ErrCodeStreamClosed}
	case !f.StreamEnded():
		return http2.StreamError{StreamID: st.id, Code: http2.ErrCodeProtocol, Cause: fmt.Errorf("a second header block without END_STREAM")}
	case len(f.PseudoFields()) > 0:
		return http2.StreamError{StreamID: st.id, Code: http2.ErrCodeProtocol, Cause: fmt.Errorf("pseudo-header in trailers")}
	}
	st.endRecv()
	return nil
}

// connectionSpecific are the fields HTTP/2 forbids (RFC 9113 §8.2.2).
var connectionSpecific = map[string]bool{
	"connection": true, "keep-alive": true, "proxy-connection": true, "transfer-encoding": true, "upgrade": true,
}

// newRequest checks a request's header block (RFC 9113 §8.3.1: the
// framer has checked names, order and duplicates of the pseudo-headers)
// and builds the request, without its body and context. declared is its
// content-length, or -1.
func (l *Conn) newRequest(f *http2.MetaHeadersFrame) (req *http.Request, declared int64, err error) {
	method := f.PseudoValue("method")
	path := f.PseudoValue("path")
	scheme := f.PseudoValue("scheme")
	authority := f.PseudoValue("authority")
	switch {
	case f.PseudoValue("status") != "":
		return nil, 0, fmt.Errorf("a response pseudo-header in a request")
	case method == "":
		return nil, 0, fmt.Errorf("no :method")
	case method == http.MethodConnect:
		if path != "" || scheme != "" || authority == "" {
			return nil, 0, fmt.Errorf("CONNECT needs :authority and no :scheme or :path")
		}
	case path == "" || scheme == "":
		return nil, 0, fmt.Errorf("no :path or :scheme")
	}
	header := make(http.Header, len(f.RegularFields()))
	declared = -1
	for _, hf := range f.RegularFields() {
		switch {
		case connectionSpecific[hf.Name]:
			return nil, 0, fmt.Errorf("connection-specific header field %q", hf.Name)
		case hf.Name == "te" && hf.Value != "trailers":
			return nil, 0, fmt.Errorf("te other than trailers")
		case hf.Name == "content-length":
			n, err := strconv.ParseUint(hf.Value, 10, 63)
			if err != nil || (declared >= 0 && int64(n) != declared) {
				return nil, 0, fmt.Errorf("bad content-length %q", hf.Value)
			}
			declared = int64(n)
		}
		header.Add(hf.Name, hf.Value)
	}
	u := &url.URL{Host: authority}
	if method != http.MethodConnect {
		if u, err = url.ParseRequestURI(path); err != nil {
			return nil, 0, fmt.Errorf("bad :path")
		}
	}
	req = &http.Request{
		Method: method, URL: u, Host: authority, RequestURI: path,
		Proto: "HTTP/2.0", ProtoMajor: 2, Header: header, ContentLength: declared,
		RemoteAddr: l.conn.RemoteAddr().String(),
	}
	return req, declared, nil
}

// runHandler serves one stream with h. A handler that returns ends the response
// (END_STREAM, then RST_STREAM(NO_ERROR) if the peer is still sending: it
// is not read any more); one that panics, as with http.ErrAbortHandler,
// resets the stream. The stream counts against MaxConcurrentStreams until
// this returns.
func (l *Conn) runHandler(h http.Handler, st *stream, req *http.Request) {
	w := &responseWriter{st: st}
	completed := false
	defer func() {
		if !completed {
			recover() // http.ErrAbortHandler, or a handler's own panic: this stream only
			st.reset(http2.ErrCodeInternal, ErrStreamReset)
			st.handlerDone()
			return
		}
		if !w.outlives {
			w.end()
		}
	}()
	h.ServeHTTP(w, req)
	completed = true
}

// end is a handler's return: the response ends (unless detached), then
// the stream is no longer the handler's.
func (w *responseWriter) end() {
	if !w.detached {
		w.finish()
	}
	w.st.handlerDone()
}

// Outlive, called by a handler, lets its response outlive the handler's
// goroutine, so that a long call need not keep a goroutine with the
// stack its start grew: when the handler returns nothing happens, and
// the returned end, called once from any goroutine, does what the return
// would have done (Detach included). Until then the stream counts as the
// handler's: its request context lives, and it counts against
// MaxConcurrentStreams. The ResponseWriter goes with end: whoever calls
// end owns it from the handler's return. nil for a ResponseWriter that is
// not the link's: that handler must not return before it is done.
func Outlive(w http.ResponseWriter) (end func()) {
	rw, ok := w.(*responseWriter)
	if !ok {
		return nil // not ours: the handler must stay
	}
	rw.outlives = true
	return rw.end
}

// handlerDone ends the handler's request context (as in net/http) and
// frees the stream's place under MaxConcurrentStreams if it is closed; a
// stream the peer did not reset earns back a reset for the budget.
func (st *stream) handlerDone() {
	st.abort()
	l := st.l
	l.mu.Lock()
	st.handlerRunning = false
	if st.state == stateClosed {
		st.uncountLocked()
	}
	l.restChangedLocked()
	if !st.resetByThePeer && l.resetBudget < l.cfg.MaxPeerResets {
		l.resetBudget++
	}
	l.mu.Unlock()
}

// responseWriter is the http.ResponseWriter of a stream on the serving
// end. As with net/http, the head is sent with the first Write or Flush,
// or when the handler returns: a handler that writes nothing ends the
// stream with that one HEADERS frame (gRPC's trailers-only answer). Header
// keys with http.TrailerPrefix, set before the handler returns, are sent
// as trailers. Every Write is sent at once. Owned by the handler's
// goroutine.
//
// The header map is made on the first Header and, once the head went
// out, keeps only the trailers set so far: a long response (a gRPC call
// open for hours) holds no map for a head it sent at its start. A handler
// calls Header again for each trailer it sets after the head.
type responseWriter struct {
	st          *stream
	header      http.Header // nil until Header is called
	status      int         // set by WriteHeader
	headersSent bool        // the head has gone out
	detached    bool        // Detach: the stream stays open for Freeze
	outlives    bool        // Outlive: the handler's return does not end the response
	err         error
}

func (w *responseWriter) Header() http.Header {
	if w.header == nil {
		w.header = make(http.Header)
	}
	return w.header
}

func (w *responseWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}

func (w *responseWriter) sendHead(end bool) error {
	if w.headersSent {
		return w.err
	}
	w.headersSent = true
	if w.status == 0 {
		w.status = http.StatusOK
	}
	head := make(http.Header, len(w.header))
	var trailers http.Header
	for k, v := range w.header {
		switch {
		case strings.HasPrefix(k, http.TrailerPrefix):
			if trailers == nil {
				trailers = make(http.Header)
			}
			trailers[k] = v
		case k != "Trailer":
			head[k] = v
		}
	}
	w.header = trailers
	w.err = w.st.writeHeaderBlock(w.status, head, end)
	return w.err
}

func (w *responseWriter) Write(p []byte) (int, error) {
	if err := w.sendHead(false); err != nil {
		return 0, err
	}
	if err := w.st.writeData(p, false); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (w *responseWriter) Flush() { w.sendHead(false) }

// CloseWrite ends the response (END_STREAM) while the request is still
// read: the serving half of a half-closed tunnel.
func (w *responseWriter) CloseWrite() error {
	if err := w.sendHead(false); err != nil {
		return err
	}
	return w.st.writeData(nil, true)
}

func (w *responseWriter) finish() {
	st := w.st
	trailers := make(http.Header)
	for k, v := range w.header {
		if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
			trailers[http.CanonicalHeaderKey(name)] = v
		}
	}
	st.l.mu.Lock()
	ended := st.sentEndLocked()
	st.l.mu.Unlock()
	switch {
	case ended: // CloseWrite ended the response already, or the stream is gone
	case !w.headersSent && len(trailers) == 0:
		w.sendHead(true)
	case len(trailers) > 0:
		if w.sendHead(false) == nil {
			st.writeHeaderBlock(0, trailers, true)
		}
	default:
		st.writeData(nil, true)
	}
	st.rmu.Lock()
	received := st.eof
	st.rmu.Unlock()
	if !received {
		st.reset(http2.ErrCodeNo, ErrStreamReset)
	}
}

// writeHeaderBlock sends one HEADERS frame: a response head (code > 0) or
// trailers (code 0), with END_STREAM if end is set.
func (st *stream) writeHeaderBlock(code int, header http.Header, end bool) error {
	l := st.l
	l.mu.Lock()
	if l.closed || st.sentEndLocked() {
		l.mu.Unlock()
		return ErrStreamReset
	}
	done := false
	if end {
		done = st.endSendLocked()
	}
	if code > 0 {
		st.answered = true
	}
	l.mu.Unlock()
	l.lockWrite()
	l.hbuf.Reset()
	if code > 0 {
		l.henc.WriteField(hf(":status", strconv.Itoa(code)))
	}
	for k, vs := range header {
		name := strings.ToLower(k)
		if connectionSpecific[name] {
			continue // not allowed in HTTP/2
		}
		for _, v := range vs {
			l.henc.WriteField(hf(name, v))
		}
	}
	err := l.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: st.id, BlockFragment: l.hbuf.Bytes(), EndStream: end, EndHeaders: true})
	l.unlockWrite()
	if err != nil {
		l.closeWith(fmt.Errorf("write: %w", err))
		return err
	}
	if done {
		st.remove()
	}
	return nil
}
