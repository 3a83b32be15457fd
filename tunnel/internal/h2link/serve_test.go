package h2link

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// rawClient is a hostile or merely strict peer of a serving end, driven
// frame by frame from a raw socket.
type rawClient struct {
	t        *testing.T
	conn     net.Conn
	fr       *http2.Framer
	henc     *hpack.Encoder
	hbuf     bytes.Buffer
	settings map[http2.SettingID]uint32 // the serving end's first SETTINGS
}

// servingPair starts a serving end with cfg and h on one side of a
// loopback TCP connection and returns it with the raw client on the other,
// which has sent the preface and read the serving end's SETTINGS. Cleanup
// closes both and waits for every goroutine the link started.
func servingPair(t *testing.T, cfg Config, h http.Handler) (*Conn, *rawClient) {
	t.Helper()
	return servingPairOn(t, "tcp", "127.0.0.1:0", cfg, h)
}

// servingPairOn is servingPair on a connection of network to address.
func servingPairOn(t *testing.T, network, address string, cfg Config, h http.Handler) (*Conn, *rawClient) {
	t.Helper()
	near, far := connPair(t, network, address)
	var wg sync.WaitGroup
	cfg.Spawn = func(f func()) { wg.Add(1); go func() { defer wg.Done(); f() }() }
	c := &rawClient{t: t, conn: near, fr: http2.NewFramer(near, near)}
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	c.fr.SetMaxReadFrameSize(MaxFrameSize)
	c.henc = hpack.NewEncoder(&c.hbuf)
	if _, err := near.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	l, err := NewServer(far, cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { l.Serve(); close(served) }()
	t.Cleanup(func() {
		l.Close()
		near.Close()
		<-served
		wg.Wait()
	})
	c.fr.WriteSettings()
	near.SetReadDeadline(time.Now().Add(5 * time.Second))
	f, err := c.fr.ReadFrame()
	if err != nil {
		t.Fatal(err)
	}
	sf, ok := f.(*http2.SettingsFrame)
	if !ok {
		t.Fatalf("first frame %v, want SETTINGS", f)
	}
	c.settings = map[http2.SettingID]uint32{}
	sf.ForeachSetting(func(s http2.Setting) error { c.settings[s.ID] = s.Val; return nil })
	return l, c
}

// request sends a GET's HEADERS on stream id.
func (c *rawClient) request(id uint32, end bool, extra ...string) error {
	c.hbuf.Reset()
	fields := append([]string{":method", "GET", ":scheme", "http", ":path", "/", ":authority", "x"}, extra...)
	for i := 0; i+1 < len(fields); i += 2 {
		c.henc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	return c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: c.hbuf.Bytes(), EndHeaders: true, EndStream: end})
}

// until reads frames until want returns true for one, failing the test
// if the connection ends or 10 s pass first.
func (c *rawClient) until(what string, want func(http2.Frame) bool) http2.Frame {
	c.t.Helper()
	c.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			c.t.Fatalf("waiting for %s: %v", what, err)
		}
		if want(f) {
			return f
		}
	}
}

func (c *rawClient) rst(id uint32, code http2.ErrCode) {
	c.t.Helper()
	f := c.until("RST_STREAM", func(f http2.Frame) bool { _, ok := f.(*http2.RSTStreamFrame); return ok }).(*http2.RSTStreamFrame)
	if f.StreamID != id || f.ErrCode != code {
		c.t.Fatalf("RST_STREAM stream %d %v, want stream %d %v", f.StreamID, f.ErrCode, id, code)
	}
}

// closedOrGoAway waits for the connection to end, and returns the GOAWAY
// code if one came first.
func (c *rawClient) closedOrGoAway(within time.Duration) (code http2.ErrCode, gotGoAway bool) {
	c.t.Helper()
	c.conn.SetReadDeadline(time.Now().Add(within))
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				c.t.Fatalf("the connection was still open after %v", within)
			}
			return code, gotGoAway
		}
		if ga, ok := f.(*http2.GoAwayFrame); ok && !gotGoAway {
			code, gotGoAway = ga.ErrCode, true
		}
	}
}

// body415 answers as the gRPC front door answers a request that is not
// gRPC: a status and a short body.
var body415 = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	w.WriteHeader(http.StatusUnsupportedMediaType)
	io.WriteString(w, "not gRPC\n")
})

// DATA on a stream the peer already ended is a stream error
// STREAM_CLOSED, whether or not the answer has gone out (RFC 9113 §5.1).
func TestServeDataAfterEndStream(t *testing.T) {
	checkNoLeaks(t)
	for range 20 { // the answer races the DATA: both orders must hold
		_, c := servingPair(t, Config{}, body415)
		c.request(1, true)
		c.fr.WriteData(1, true, []byte("test"))
		c.rst(1, http2.ErrCodeStreamClosed)
	}
}

// Frames on a stream that was never opened are a connection error.
func TestServeFramesOnIdleStreams(t *testing.T) {
	checkNoLeaks(t)
	for name, send := range map[string]func(c *rawClient){
		"DATA":          func(c *rawClient) { c.fr.WriteData(1, true, []byte("x")) },
		"RST_STREAM":    func(c *rawClient) { c.fr.WriteRSTStream(1, http2.ErrCodeCancel) },
		"WINDOW_UPDATE": func(c *rawClient) { c.fr.WriteWindowUpdate(1, 100) },
		"even HEADERS":  func(c *rawClient) { c.request(2, true) },
		"lower HEADERS": func(c *rawClient) { c.request(5, true); c.request(3, true) },
	} {
		t.Run(name, func(t *testing.T) {
			_, c := servingPair(t, Config{}, body415)
			send(c)
			if code, ok := c.closedOrGoAway(5 * time.Second); !ok || code != http2.ErrCodeProtocol {
				t.Fatalf("GOAWAY %v (sent: %v), want PROTOCOL_ERROR", code, ok)
			}
		})
	}
}

// Malformed requests (RFC 9113 §8) are refused with PROTOCOL_ERROR on
// their stream; the connection goes on.
func TestServeMalformedRequests(t *testing.T) {
	checkNoLeaks(t)
	for name, fields := range map[string][]string{
		"response pseudo-header": {":status", "200"},
		"connection-specific":    {"connection", "keep-alive"},
		"te not trailers":        {"te", "gzip"},
		"bad content-length":     {"content-length", "x"},
	} {
		t.Run(name, func(t *testing.T) {
			_, c := servingPair(t, Config{}, body415)
			c.request(1, true, fields...)
			c.rst(1, http2.ErrCodeProtocol)
			c.request(3, true)
			c.until("an answer on stream 3", func(f http2.Frame) bool { return f.Header().StreamID == 3 && f.Header().Type == http2.FrameHeaders })
		})
	}
	t.Run("content-length not matching DATA", func(t *testing.T) {
		drain := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) })
		_, c := servingPair(t, Config{}, drain)
		c.request(1, false, "content-length", "10")
		c.fr.WriteData(1, true, []byte("short"))
		c.rst(1, http2.ErrCodeProtocol)
	})
	t.Run("second HEADERS without END_STREAM", func(t *testing.T) {
		_, c := servingPair(t, Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) }))
		c.request(1, false)
		c.hbuf.Reset()
		c.henc.WriteField(hpack.HeaderField{Name: "x-trailer", Value: "1"})
		c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: c.hbuf.Bytes(), EndHeaders: true})
		c.rst(1, http2.ErrCodeProtocol)
	})
	t.Run("depends on itself", func(t *testing.T) {
		_, c := servingPair(t, Config{}, body415)
		c.fr.WritePriority(1, http2.PriorityParam{StreamDep: 1, Weight: 10})
		c.rst(1, http2.ErrCodeProtocol)
		c.request(1, true) // PRIORITY did not open stream 1: it is still new
		c.until("an answer on stream 1", func(f http2.Frame) bool { return f.Header().StreamID == 1 && f.Header().Type == http2.FrameHeaders })
	})
	t.Run("HEADERS depending on itself", func(t *testing.T) {
		_, c := servingPair(t, Config{}, body415)
		c.hbuf.Reset()
		for _, f := range [][2]string{{":method", "GET"}, {":scheme", "http"}, {":path", "/"}, {":authority", "x"}} {
			c.henc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
		}
		c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: c.hbuf.Bytes(), EndHeaders: true, EndStream: true,
			Priority: http2.PriorityParam{StreamDep: 1, Weight: 10}})
		c.rst(1, http2.ErrCodeProtocol)
	})
}

// A WINDOW_UPDATE that takes a stream's window past 2^31-1 resets that
// stream (FLOW_CONTROL_ERROR); past it on the connection, the connection.
func TestServeWindowOverflow(t *testing.T) {
	checkNoLeaks(t)
	block := make(chan struct{})
	defer close(block)
	stall := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-block:
		case <-r.Context().Done():
		}
	})
	_, c := servingPair(t, Config{}, stall)
	c.request(1, true)
	c.fr.WriteWindowUpdate(1, maxWindow)
	c.rst(1, http2.ErrCodeFlowControl)
	c.fr.WriteWindowUpdate(0, maxWindow)
	if code, ok := c.closedOrGoAway(5 * time.Second); !ok || code != http2.ErrCodeFlowControl {
		t.Fatalf("GOAWAY %v (sent: %v), want FLOW_CONTROL_ERROR", code, ok)
	}
}

// A peer that makes the link answer (PING, SETTINGS, refused streams) and
// never reads is dropped once MaxQueuedControl frames wait: the queue does
// not grow without bound.
func TestServeControlFloodWithoutReading(t *testing.T) {
	checkNoLeaks(t)
	floods := map[string]func(c *rawClient, i uint32) error{
		"PING":     func(c *rawClient, i uint32) error { return c.fr.WritePing(false, [8]byte{byte(i)}) },
		"SETTINGS": func(c *rawClient, i uint32) error { return c.fr.WriteSettings() },
		"refused HEADERS": func(c *rawClient, i uint32) error {
			c.hbuf.Reset()
			c.henc.WriteField(hpack.HeaderField{Name: ":method", Value: "GET"})
			c.henc.WriteField(hpack.HeaderField{Name: ":scheme", Value: "http"})
			c.henc.WriteField(hpack.HeaderField{Name: ":path", Value: "/"})
			return c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 2*i + 3, BlockFragment: c.hbuf.Bytes(), EndHeaders: true, EndStream: true})
		},
	}
	for name, send := range floods {
		t.Run(name, func(t *testing.T) {
			block := make(chan struct{})
			defer close(block)
			stall := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				select {
				case <-block:
				case <-r.Context().Done():
				}
			})
			// A Unix socket: small fixed buffers, where loopback TCP would
			// take megabytes of answers before the link has to queue any.
			l, c := servingPairOn(t, "unix", filepath.Join(t.TempDir(), "s"), Config{MaxConcurrentStreams: 1, MaxQueuedControl: 1000, MaxPeerResets: 1 << 30}, stall)
			c.conn.SetDeadline(time.Time{})
			c.request(1, false) // holds the one stream, so later ones are refused
			// No write deadline (a write cut short would break the framing):
			// a timer ends the flood if the link never drops it.
			watchdog := time.AfterFunc(20*time.Second, func() { c.conn.Close() })
			defer watchdog.Stop()
			var i uint32
			for ; ; i++ {
				if send(c, i) != nil {
					break // the link closed the connection
				}
				if i%1024 == 0 {
					l.ctlMu.Lock()
					queued := len(l.ctlQueue)
					l.ctlMu.Unlock()
					if queued > l.cfg.MaxQueuedControl {
						t.Fatalf("%d control frames queued, limit %d", queued, l.cfg.MaxQueuedControl)
					}
				}
			}
			if !watchdog.Stop() {
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Fatalf("still serving after 20 s of %s frames sent without reading\n%s", name, onlyOurs(string(buf)))
			}
			select {
			case <-l.Done():
			case <-time.After(5 * time.Second):
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Fatalf("still serving after %d %s frames sent without reading\n%s", i, name, onlyOurs(string(buf)))
			}
			if !errors.Is(l.err(), errCalm) {
				t.Fatalf("connection ended with %v, want ENHANCE_YOUR_CALM", l.err())
			}
			t.Logf("dropped after %d %s frames", i, name)
		})
	}
}

// A stream counts against MaxConcurrentStreams until its handler returned:
// resetting streams does not let a peer run more handlers than the limit.
func TestServeStreamCountsUntilHandlerReturns(t *testing.T) {
	checkNoLeaks(t)
	release := make(chan struct{})
	var running, most atomic.Int64
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := running.Add(1)
		defer running.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		<-release // ignores its context, as a handler in the middle of a TokenReview might
	})
	l, c := servingPair(t, Config{MaxConcurrentStreams: 2}, slow)
	if got := c.settings[http2.SettingMaxConcurrentStreams]; got != 2 {
		t.Fatalf("SETTINGS_MAX_CONCURRENT_STREAMS %d, want 2", got)
	}
	c.request(1, true)
	c.request(3, true)
	c.fr.WriteRSTStream(1, http2.ErrCodeCancel)
	c.fr.WriteRSTStream(3, http2.ErrCodeCancel)
	c.request(5, true)
	c.rst(5, http2.ErrCodeRefusedStream)
	close(release)
	deadline := time.Now().Add(5 * time.Second)
	for {
		l.mu.Lock()
		counted := l.counted
		l.mu.Unlock()
		if counted == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d streams still counted after their handlers returned", counted)
		}
		time.Sleep(5 * time.Millisecond)
	}
	c.request(7, true)
	c.until("an answer on stream 7", func(f http2.Frame) bool { return f.Header().StreamID == 7 && f.Header().Type == http2.FrameHeaders })
	if m := most.Load(); m > 2 {
		t.Fatalf("%d handlers ran at once, limit 2", m)
	}
}

// A peer that opens streams and resets them at once (rapid reset) is
// dropped with ENHANCE_YOUR_CALM once its reset budget is spent, and never
// has more handlers running than the limit.
func TestServeRapidResetDropped(t *testing.T) {
	checkNoLeaks(t)
	var running, most, started atomic.Int64
	work := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		started.Add(1)
		n := running.Add(1)
		defer running.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		select { // a review that takes a while, cut short by the reset
		case <-r.Context().Done():
		case <-time.After(time.Second):
		}
	})
	l, c := servingPair(t, Config{MaxConcurrentStreams: 4, MaxPeerResets: 100}, work)
	go io.Copy(io.Discard, c.conn) // a reader: only the resets count here
	var pairs int
	for id := uint32(1); pairs < 5000; id += 2 {
		c.conn.SetWriteDeadline(time.Now().Add(time.Second))
		c.hbuf.Reset()
		c.henc.WriteField(hpack.HeaderField{Name: ":method", Value: "POST"})
		c.henc.WriteField(hpack.HeaderField{Name: ":scheme", Value: "http"})
		c.henc.WriteField(hpack.HeaderField{Name: ":path", Value: "/AgentService/Connect"})
		if c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: c.hbuf.Bytes(), EndHeaders: true}) != nil ||
			c.fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
			break
		}
		pairs++
	}
	select {
	case <-l.Done():
	case <-time.After(5 * time.Second):
		t.Fatalf("still serving after %d HEADERS+RST_STREAM pairs", pairs)
	}
	if !errors.Is(l.err(), errCalm) {
		t.Fatalf("connection ended with %v, want ENHANCE_YOUR_CALM", l.err())
	}
	if m := most.Load(); m > 4 {
		t.Fatalf("%d handlers ran at once, limit 4", m)
	}
	t.Logf("dropped after %d pairs; %d handlers started, at most %d at once", pairs, started.Load(), most.Load())
}

// A legitimate peer that cancels some of its streams is not mistaken for
// a rapid reset: each stream that finishes earns a reset back.
func TestServeResetsWithinBudgetKeepConnection(t *testing.T) {
	checkNoLeaks(t)
	l, c := servingPair(t, Config{MaxPeerResets: 10}, body415)
	for id := uint32(1); id < 200; id += 2 {
		c.request(id, true)
		c.until("the answer's end", func(f http2.Frame) bool {
			return f.Header().StreamID == id && f.Header().Flags.Has(http2.FlagDataEndStream)
		})
		if id%4 == 1 {
			c.fr.WriteRSTStream(id, http2.ErrCodeCancel) // after the end: costs nothing
		}
	}
	select {
	case <-l.Done():
		t.Fatalf("connection dropped: %v", l.err())
	default:
	}
}

// Before admission a serving end gives the small windows; RaiseWindows
// gives the full ones (SETTINGS and WINDOW_UPDATE).
func TestServePreAdmitWindows(t *testing.T) {
	checkNoLeaks(t)
	drain := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
	})
	l, c := servingPair(t, Config{PreAdmitStreamWindow: 4 << 10, PreAdmitConnWindow: 64 << 10}, drain)
	if got := c.settings[http2.SettingInitialWindowSize]; got != 4<<10 {
		t.Fatalf("SETTINGS_INITIAL_WINDOW_SIZE %d before admission, want 4096", got)
	}
	c.request(1, false)
	c.fr.WriteData(1, false, make([]byte, 8<<10)) // twice the window
	c.rst(1, http2.ErrCodeFlowControl)

	l.RaiseWindows()
	var sawSettings, sawConnUpdate bool
	c.until("SETTINGS and WINDOW_UPDATE", func(f http2.Frame) bool {
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if v, ok := f.Value(http2.SettingInitialWindowSize); ok && v == DefaultStreamWindow {
				sawSettings = true
			}
		case *http2.WindowUpdateFrame:
			if f.StreamID == 0 && f.Increment == startConnWindow-64<<10 {
				sawConnUpdate = true
			}
		}
		return sawSettings && sawConnUpdate
	})
	c.fr.WriteSettingsAck()
	c.request(3, false)
	c.fr.WriteData(3, true, make([]byte, 64<<10))
	c.until("the answer on stream 3", func(f http2.Frame) bool {
		if rs, ok := f.(*http2.RSTStreamFrame); ok && rs.StreamID == 3 {
			t.Fatalf("stream 3 reset (%v) after RaiseWindows", rs.ErrCode)
		}
		return f.Header().StreamID == 3 && f.Header().Type == http2.FrameHeaders
	})
}

// Many streams opened while the connection is closed under them: every
// stream is fully set up before the close can find it (run with -race).
func TestServeCloseWhileStreamsOpen(t *testing.T) {
	checkNoLeaks(t)
	for range 20 {
		echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(200)
			io.Copy(w, r.Body)
		})
		l, c := servingPair(t, Config{MaxConcurrentStreams: 1000}, echo)
		go io.Copy(io.Discard, c.conn)
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			time.Sleep(time.Duration(len(t.Name())%3) * time.Millisecond)
			l.Close()
			cancel()
		}()
		for id := uint32(1); ctx.Err() == nil && id < 4000; id += 2 {
			c.conn.SetWriteDeadline(time.Now().Add(time.Second))
			if c.request(id, false) != nil {
				break
			}
		}
		<-ctx.Done()
	}
}

// Streams reset after their answer (a client that hangs up on its tunnel)
// cost no budget, however many: only the unanswered ones are rapid resets.
func TestServeResetsAfterAnswerAreFree(t *testing.T) {
	checkNoLeaks(t)
	tunnel := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	})
	l, c := servingPair(t, Config{MaxPeerResets: 5, MaxConcurrentStreams: 1000}, tunnel)
	for id := uint32(1); id < 100; id += 2 {
		c.request(id, false)
		c.until("the answer", func(f http2.Frame) bool { return f.Header().StreamID == id && f.Header().Type == http2.FrameHeaders })
	}
	for id := uint32(1); id < 100; id += 2 {
		c.fr.WriteRSTStream(id, http2.ErrCodeCancel)
	}
	c.fr.WritePing(false, [8]byte{1})
	c.until("the PING's answer", func(f http2.Frame) bool { p, ok := f.(*http2.PingFrame); return ok && p.IsAck() })
	select {
	case <-l.Done():
		t.Fatalf("connection dropped after resets of answered streams: %v", l.err())
	default:
	}
}

// A handler that holds its response returns with the stream open and
// counted as its own; the body's Notify tells of each change a Read would
// see (bytes, END_STREAM) once, from the link, with no goroutine waiting;
// end finishes the response as the handler's return would have.
func TestServeOutliveAndNotify(t *testing.T) {
	checkNoLeaks(t)
	type outlivingCall struct {
		end  func()
		body *Body
	}
	calls := make(chan outlivingCall, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		end := Outlive(w)
		w.(http.Flusher).Flush()
		calls <- outlivingCall{end, r.Body.(*Body)}
	})
	l, c := servingPair(t, Config{}, h)
	c.request(1, false)
	hc := <-calls
	c.until("the answer's HEADERS", func(f http2.Frame) bool { return f.Header().Type == http2.FrameHeaders })
	counted := func() int {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.counted
	}
	woken := make(chan struct{}, 4)
	notify := func() { woken <- struct{}{} }
	if hc.body.Notify(notify) {
		t.Fatal("Notify reported a quiet stream readable")
	}
	c.fr.WriteData(1, false, []byte("hi"))
	<-woken
	if !hc.body.Notify(notify) {
		t.Fatal("Notify reported a stream with bytes queued as quiet")
	}
	buf := make([]byte, 8)
	if n, err := hc.body.Read(buf); err != nil || string(buf[:n]) != "hi" {
		t.Fatalf("Read: %q %v", buf[:n], err)
	}
	if hc.body.Notify(notify) {
		t.Fatal("Notify reported a drained stream readable")
	}
	c.fr.WriteData(1, true, nil)
	<-woken
	if n, err := hc.body.Read(buf); n != 0 || err != io.EOF {
		t.Fatalf("Read after END_STREAM: %d %v, want io.EOF", n, err)
	}
	if got := counted(); got != 1 {
		t.Fatalf("%d streams counted while the response outlives its handler, want 1", got)
	}
	select {
	case <-woken:
		t.Fatal("Notify's function ran more than once for one call")
	default:
	}
	hc.end()
	c.until("END_STREAM on stream 1", func(f http2.Frame) bool {
		return f.Header().StreamID == 1 && f.Header().Flags.Has(http2.FlagDataEndStream)
	})
	// The read loop wakes the reader with the client's END_STREAM before it
	// moves the stream's state, so end may find the stream still open; the
	// read loop then closes it and frees its place.
	for deadline := time.Now().Add(5 * time.Second); counted() != 0 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if got := counted(); got != 0 {
		t.Fatalf("%d streams counted once the outliving response ended, want 0", got)
	}
}

// TestConnCreditRidesWithStreamCredit: a stream's WINDOW_UPDATE carries
// the connection's credit pending then, and the connection sends no
// update of its own for less than a quarter of its window: 160 KiB read
// on a 512 KiB stream window (an update per 128 KiB) and a 1 MiB
// connection window (alone per 256 KiB) bring one stream update with the
// connection's credit beside it, and none alone.
func TestConnCreditRidesWithStreamCredit(t *testing.T) {
	checkNoLeaks(t)
	drain := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.WriteHeader(200)
	})
	l, c := servingPair(t, Config{StreamWindow: 512 << 10}, drain)
	l.mu.Lock()
	target := int64(l.recvTarget)
	l.mu.Unlock()
	const frame, frames = 16 << 10, 10 // 160 KiB
	c.until("the window's first raise", func(f http2.Frame) bool {
		wu, ok := f.(*http2.WindowUpdateFrame)
		return ok && wu.StreamID == 0
	})
	c.request(1, false)
	go func() {
		for i := range frames {
			if c.fr.WriteData(1, i == frames-1, make([]byte, frame)) != nil {
				return
			}
		}
	}()
	var alone, riding, streamUpdates, credit, streamCredit int64
	afterStream := false
	c.until("the frame after stream 1's WINDOW_UPDATE", func(f http2.Frame) bool {
		wu, ok := f.(*http2.WindowUpdateFrame)
		switch {
		case ok && wu.StreamID == 1:
			streamUpdates++
			streamCredit += int64(wu.Increment)
		case ok && wu.StreamID == 0 && afterStream:
			riding++
			credit += int64(wu.Increment)
		case ok && wu.StreamID == 0:
			alone++
			credit += int64(wu.Increment)
		}
		seen := afterStream
		afterStream = ok && wu.StreamID == 1
		return seen
	})
	t.Logf("stream updates %d; connection updates riding with them %d, alone %d; %d bytes of credit for %d sent, window %d", streamUpdates, riding, alone, credit, frame*frames, target)
	if target != 1<<20 || streamUpdates != 1 {
		t.Fatalf("window %d and %d stream updates: want 1 MiB and one (the test's premise)", target, streamUpdates)
	}
	if alone > 0 || riding != 1 {
		t.Errorf("%d connection WINDOW_UPDATEs alone, %d with the stream's: want none alone, one beside it", alone, riding)
	}
	if credit < streamCredit {
		t.Errorf("%d bytes of connection credit back with %d of the stream's: want at least as much", credit, streamCredit)
	}
}

// Config.Take chooses each stream's handler before anything runs for it;
// a stream it refuses gets REFUSED_STREAM, runs no handler and does not
// count against MaxConcurrentStreams, and the link serves the next one.
func TestServeTakeChoosesOrRefuses(t *testing.T) {
	checkNoLeaks(t)
	var taken, served atomic.Int64
	noContent := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		w.WriteHeader(http.StatusNoContent)
	})
	take := func(r *http.Request) http.Handler {
		taken.Add(1)
		if r.Header.Get("x-refuse") != "" {
			return nil
		}
		return noContent
	}
	l, c := servingPair(t, Config{MaxConcurrentStreams: 1, Take: take}, nil)
	c.request(1, true, "x-refuse", "1")
	c.rst(1, http2.ErrCodeRefusedStream)
	l.mu.Lock()
	counted := l.counted
	l.mu.Unlock()
	if counted != 0 || served.Load() != 0 {
		t.Fatalf("a refused stream: %d counted, %d handlers ran; want none", counted, served.Load())
	}
	c.request(3, true)
	f := c.until("an answer on stream 3", func(f http2.Frame) bool { return f.Header().StreamID == 3 && f.Header().Type == http2.FrameHeaders })
	if status := f.(*http2.MetaHeadersFrame).PseudoValue("status"); status != "204" {
		t.Fatalf("stream 3 answered %s, want 204 from the handler Take chose", status)
	}
	if n, m := taken.Load(), served.Load(); n != 2 || m != 1 {
		t.Fatalf("Take asked %d times and %d handlers ran; want 2 and 1", n, m)
	}
}
