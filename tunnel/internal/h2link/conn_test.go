package h2link

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// fakeAgent is the agent's end of a link, driven frame by frame by a test.
type fakeAgent struct {
	t    *testing.T
	conn net.Conn
	fr   *http2.Framer
	henc *hpack.Encoder
	hbuf bytes.Buffer
}

// newLinkPair returns a link and the fake agent on the other end of a
// loopback TCP connection. The fake agent has read the preface and the
// link's SETTINGS and answered with settings of its own.
func newLinkPair(t *testing.T, keepAlive, pingWait time.Duration, settings ...http2.Setting) (*Conn, *fakeAgent) {
	t.Helper()
	return newLinkPairOn(t, "tcp", "127.0.0.1:0", keepAlive, pingWait, settings...)
}

// newLinkPairOn is newLinkPair on a connection of network to address.
func newLinkPairOn(t *testing.T, network, address string, keepAlive, pingWait time.Duration, settings ...http2.Setting) (*Conn, *fakeAgent) {
	t.Helper()
	client, server := connPair(t, network, address)
	var wg sync.WaitGroup
	spawn := func(f func()) { wg.Add(1); go func() { defer wg.Done(); f() }() }
	l, err := NewClient(client, Config{KeepAlive: keepAlive, PingTimeout: pingWait, Spawn: spawn})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		l.Close()
		server.Close()
		wg.Wait()
	})
	a := &fakeAgent{t: t, conn: server, fr: http2.NewFramer(server, server)}
	a.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	a.henc = hpack.NewEncoder(&a.hbuf)
	preface := make([]byte, len(http2.ClientPreface))
	server.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(server, preface); err != nil || string(preface) != http2.ClientPreface {
		t.Fatalf("preface %q, %v", preface, err)
	}
	if err := a.fr.WriteSettings(settings...); err != nil {
		t.Fatal(err)
	}
	a.fr.WriteWindowUpdate(0, 1<<30)
	return l, a
}

// waitLinkEnded fails the test with failure unless the link's read loop
// ends within 5 s.
func waitLinkEnded(t *testing.T, l *Conn, failure string) {
	t.Helper()
	select {
	case <-l.readerDone:
	case <-time.After(5 * time.Second):
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		t.Fatalf("%s\n%s", failure, onlyOurs(string(buf)))
	}
}

// next returns the next frame that is not SETTINGS, WINDOW_UPDATE or PING ACK.
func (a *fakeAgent) next() http2.Frame {
	a.t.Helper()
	for {
		a.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		f, err := a.fr.ReadFrame()
		if err != nil {
			a.t.Fatalf("fake agent read: %v", err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame, *http2.WindowUpdateFrame:
			continue
		case *http2.PingFrame:
			if f.IsAck() {
				continue
			}
		}
		return f
	}
}

func (a *fakeAgent) respond(id uint32, status string, end bool) {
	a.hbuf.Reset()
	a.henc.WriteField(hpack.HeaderField{Name: ":status", Value: status})
	if err := a.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: a.hbuf.Bytes(), EndHeaders: true, EndStream: end}); err != nil {
		a.t.Fatal(err)
	}
}

func connectRequest(ctx context.Context, body io.ReadCloser) *http.Request {
	req := &http.Request{Method: http.MethodConnect, URL: &url.URL{Host: "10.0.0.1:443"}, Host: "10.0.0.1:443", Header: http.Header{}, Body: body}
	return req.WithContext(ctx)
}

// trackedBody is an upload that records its Close.
type trackedBody struct {
	io.Reader
	closed chan struct{}
	once   sync.Once
}

func newTrackedBody(r io.Reader) *trackedBody {
	return &trackedBody{Reader: r, closed: make(chan struct{})}
}

func (b *trackedBody) Close() error { b.once.Do(func() { close(b.closed) }); return nil }

// roundTripAsync runs RoundTrip on a goroutine the test waits for.
func roundTripAsync(t *testing.T, l *Conn, req *http.Request) <-chan rtResult {
	ch := make(chan rtResult, 1)
	go func() {
		resp, err := l.RoundTrip(req)
		ch <- rtResult{resp, err}
	}()
	return ch
}

// openAnswered opens a tunnel with an empty upload and answers it 200.
func openAnswered(t *testing.T, l *Conn, a *fakeAgent) (*http2.MetaHeadersFrame, *http.Response) {
	t.Helper()
	res := roundTripAsync(t, l, connectRequest(context.Background(), newTrackedBody(bytes.NewReader(nil))))
	h := a.next().(*http2.MetaHeadersFrame)
	a.respond(h.StreamID, "200", false)
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	return h, r.resp
}

type rtResult struct {
	resp *http.Response
	err  error
}

func TestLinkConnectHeadersAndEndToEnd(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	body := newTrackedBody(bytes.NewReader([]byte("upload")))
	res := roundTripAsync(t, l, connectRequest(context.Background(), body))

	h, ok := a.next().(*http2.MetaHeadersFrame)
	if !ok {
		t.Fatal("first frame is not HEADERS")
	}
	if h.PseudoValue("method") != "CONNECT" || h.PseudoValue("authority") != "10.0.0.1:443" || h.PseudoValue("path") != "" || h.StreamEnded() {
		t.Fatalf("CONNECT headers: method %q authority %q path %q end %v", h.PseudoValue("method"), h.PseudoValue("authority"), h.PseudoValue("path"), h.StreamEnded())
	}
	a.respond(h.StreamID, "200", false)
	r := <-res
	if r.err != nil || r.resp.StatusCode != 200 {
		t.Fatalf("RoundTrip: %v %v", r.resp, r.err)
	}
	// The upload arrives, then END_STREAM.
	var got []byte
	for {
		d, ok := a.next().(*http2.DataFrame)
		if !ok {
			t.Fatal("expected DATA")
		}
		got = append(got, d.Data()...)
		if d.StreamEnded() {
			break
		}
	}
	if string(got) != "upload" {
		t.Fatalf("upload %q", got)
	}
	// The download, END_STREAM, then RST_STREAM(NO_ERROR) as Go's server
	// sends: nothing received is lost.
	a.fr.WriteData(h.StreamID, false, []byte("down"))
	a.fr.WriteData(h.StreamID, true, []byte("load"))
	a.fr.WriteRSTStream(h.StreamID, http2.ErrCodeNo)
	all, err := io.ReadAll(r.resp.Body)
	if err != nil || string(all) != "download" {
		t.Fatalf("download %q, %v", all, err)
	}
	select {
	case <-body.closed:
	case <-time.After(5 * time.Second):
		t.Fatal("upload body not closed when the stream ended")
	}
	r.resp.Body.Close()
	if l.CanTakeNewRequest() != true {
		t.Fatal("link refuses new streams after a clean one")
	}
}

func TestLinkResetBeforeAnswerIsRetryable(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	body := newTrackedBody(bytes.NewReader(nil))
	res := roundTripAsync(t, l, connectRequest(context.Background(), body))
	h := a.next().(*http2.MetaHeadersFrame)
	a.fr.WriteRSTStream(h.StreamID, http2.ErrCodeRefusedStream)
	r := <-res
	if !errors.Is(r.err, ErrStreamReset) {
		t.Fatalf("RoundTrip after RST_STREAM: %v (want a plain error the server retries)", r.err)
	}
	<-body.closed
}

func TestLinkGoAwayRefusesUnseenStreams(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	res := roundTripAsync(t, l, connectRequest(context.Background(), newTrackedBody(bytes.NewReader(nil))))
	h := a.next().(*http2.MetaHeadersFrame)
	a.fr.WriteGoAway(h.StreamID-1, http2.ErrCodeNo, nil) // the stream was never seen
	r := <-res
	if !errors.Is(r.err, ErrGoAway) {
		t.Fatalf("err %v, want ErrGoAway", r.err)
	}
	if l.CanTakeNewRequest() {
		t.Fatal("link takes new streams after GOAWAY")
	}
}

func TestLinkContextCancelResetsStream(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	ctx, cancel := context.WithCancel(context.Background())
	body := newTrackedBody(bytes.NewReader(nil))
	res := roundTripAsync(t, l, connectRequest(ctx, body))
	h := a.next().(*http2.MetaHeadersFrame)
	a.respond(h.StreamID, "200", false)
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	cancel()
	for {
		f := a.next()
		if rst, ok := f.(*http2.RSTStreamFrame); ok {
			if rst.StreamID != h.StreamID || rst.ErrCode != http2.ErrCodeCancel {
				t.Fatalf("RST_STREAM %v %v", rst.StreamID, rst.ErrCode)
			}
			break
		}
	}
	if _, err := r.resp.Body.Read(make([]byte, 1)); err == nil {
		t.Fatal("read after cancel succeeded")
	}
}

func TestLinkHonoursSmallSendWindow(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 100})
	payload := bytes.Repeat([]byte("0123456789"), 100) // 1000 bytes
	// The upload starts after the answer, as a tunnel's does: by then the
	// agent's SETTINGS (sent before it) have arrived.
	pr, pw := io.Pipe()
	res := roundTripAsync(t, l, connectRequest(context.Background(), newTrackedBody(pr)))
	h := a.next().(*http2.MetaHeadersFrame)
	a.respond(h.StreamID, "200", false)
	if r := <-res; r.err != nil {
		t.Fatal(r.err)
	}
	go func() { pw.Write(payload); pw.Close() }()
	var got []byte
	for {
		d := a.next().(*http2.DataFrame)
		if len(d.Data()) > 100 {
			t.Fatalf("a %d-byte DATA frame in a 100-byte window", len(d.Data()))
		}
		got = append(got, d.Data()...)
		if d.StreamEnded() {
			break
		}
		if len(d.Data()) > 0 {
			a.fr.WriteWindowUpdate(h.StreamID, uint32(len(d.Data())))
		}
	}
	if !bytes.Equal(got, payload) {
		t.Fatal("upload damaged under flow control")
	}
}

func TestLinkOverrunWindowResetsStreamOnly(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	h, resp := openAnswered(t, l, a)
	chunk := make([]byte, MaxFrameSize)
	for range DefaultStreamWindow/MaxFrameSize + 1 { // one frame past the window, nobody reading
		a.fr.WriteData(h.StreamID, false, chunk)
	}
	for {
		if rst, ok := a.next().(*http2.RSTStreamFrame); ok {
			if rst.ErrCode != http2.ErrCodeFlowControl {
				t.Fatalf("reset with %v", rst.ErrCode)
			}
			break
		}
	}
	if _, err := io.ReadAll(resp.Body); err == nil {
		t.Fatal("the overrun stream read to a clean end")
	}
	if !l.CanTakeNewRequest() {
		t.Fatal("the link died with the stream")
	}
}

func TestLinkTinyFramesShareChunks(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	h, resp := openAnswered(t, l, a)
	const frames = 2000
	for i := range frames {
		a.fr.WriteData(h.StreamID, i == frames-1, []byte{byte(i)})
	}
	st := resp.Body.(*Body).st
	deadline := time.Now().Add(5 * time.Second)
	for {
		st.rmu.Lock()
		end, chunks := st.eof, len(st.queue)
		st.rmu.Unlock()
		if end {
			if chunks > 1 {
				t.Fatalf("%d one-byte frames took %d chunks", frames, chunks)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("frames did not arrive")
		}
		time.Sleep(5 * time.Millisecond)
	}
	all, err := io.ReadAll(resp.Body)
	if err != nil || len(all) != frames || all[frames-1] != byte((frames-1)%256) {
		t.Fatalf("read %d bytes, %v", len(all), err)
	}
}

func TestLinkUnansweredPingClosesLink(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 100*time.Millisecond, 200*time.Millisecond)
	_ = a // the fake agent reads nothing more and answers nothing
	start := time.Now()
	waitLinkEnded(t, l, "link with a silent peer still open after 5s")
	if took := time.Since(start); took < 250*time.Millisecond {
		t.Fatalf("closed after %v, before keepalive + ping timeout", took)
	}
	if l.CanTakeNewRequest() {
		t.Fatal("closed link takes new streams")
	}
}

// TestLinkAnsweredPingKeepsLink: a link whose keepalive PINGs are answered
// stays open; it fails when the link sends no PING or closes one answered.
func TestLinkAnsweredPingKeepsLink(t *testing.T) {
	checkNoLeaks(t)
	const keepAlive, pingTimeout = 50 * time.Millisecond, 100 * time.Millisecond
	l, a := newLinkPair(t, keepAlive, pingTimeout)
	// Four answered PINGs, each sent after keepAlive of quiet: the link
	// lives through more than one ping timeout on answers alone.
	const want = 4
	answered := make(chan int, 1)
	go func() { // answer PINGs like a live agent until want are answered
		n := 0
		defer func() { answered <- n }()
		for n < want {
			// Bounded: a link that sends no PING fails the test here.
			a.conn.SetDeadline(time.Now().Add(5 * time.Second))
			f, err := a.fr.ReadFrame()
			if err != nil {
				return // the link closed, or sent no PING in time
			}
			if p, ok := f.(*http2.PingFrame); ok && !p.IsAck() {
				if err := a.fr.WritePing(true, p.Data); err != nil {
					return
				}
				n++
			}
		}
	}()
	if n := <-answered; n < want {
		t.Fatalf("%d PINGs answered, want %d: the link sent too few or closed", n, want)
	}
	if !l.CanTakeNewRequest() {
		t.Fatal("a link whose PINGs are answered was closed")
	}
}

// FuzzLinkFrames feeds arbitrary bytes to a link as the agent's side of
// the connection, with one tunnel open: nothing may panic or hang, and the
// tunnel ends with a response or an error.
func FuzzLinkFrames(f *testing.F) {
	var seed bytes.Buffer
	fr := http2.NewFramer(&seed, nil)
	fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 10})
	fr.WriteWindowUpdate(1, 100)
	fr.WriteData(1, true, []byte("x"))
	fr.WriteRSTStream(1, http2.ErrCodeNo)
	fr.WritePing(false, [8]byte{1})
	fr.WriteGoAway(0, http2.ErrCodeNo, nil)
	f.Add(seed.Bytes())
	f.Add([]byte("\x00\x00\x04\x00\x01\x00\x00\x00\x01abcd"))
	f.Add([]byte("\x00\x00\x00\x04\x00\x00\x00\x00\x00"))
	f.Add([]byte("\xff\xff\xff\x01\x05\x00\x00\x00\x01"))
	f.Fuzz(func(t *testing.T, data []byte) {
		l, a := newLinkPair(t, 0, 0)
		res := roundTripAsync(t, l, connectRequest(context.Background(), newTrackedBody(bytes.NewReader([]byte("up")))))
		a.conn.SetWriteDeadline(time.Now().Add(2 * time.Second))
		a.conn.Write(data)
		a.conn.Close() // then the connection ends
		select {
		case r := <-res:
			if r.err == nil {
				io.Copy(io.Discard, r.resp.Body)
				r.resp.Body.Close()
			}
		case <-time.After(5 * time.Second):
			t.Fatal("RoundTrip hung")
		}
		waitLinkEnded(t, l, "link did not end with its connection")
	})
}

// TestLinkPeerVanishesMidDownload resets the connection while a reader is
// consuming a download and returning window credit: the reader must see
// the end, never hang (a failed write of that credit once deadlocked it).
func TestLinkPeerVanishesMidDownload(t *testing.T) {
	checkNoLeaks(t)
	for range 20 {
		l, a := newLinkPair(t, 0, 0)
		h, resp := openAnswered(t, l, a)
		done := make(chan error, 1)
		go func() {
			_, err := io.Copy(io.Discard, resp.Body)
			done <- err
		}()
		chunk := make([]byte, 16<<10)
		for range 32 { // 512 KiB: several window refills
			a.fr.WriteData(h.StreamID, false, chunk)
		}
		a.conn.(*net.TCPConn).SetLinger(0)
		a.conn.Close()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("reader still blocked 5s after the agent's connection was reset")
		}
		waitLinkEnded(t, l, "link still open 5s after its connection was reset")
	}
}

// FuzzAgentLinkFrames feeds arbitrary bytes to the agent's end after the
// client preface: nothing may panic or hang, and every handler ends.
func FuzzAgentLinkFrames(f *testing.F) {
	var seed bytes.Buffer
	fr := http2.NewFramer(&seed, nil)
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
	enc.WriteField(hpack.HeaderField{Name: ":authority", Value: "10.0.0.1:80"})
	fr.WriteSettings()
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
	fr.WriteData(1, false, []byte("hello"))
	fr.WriteWindowUpdate(1, 10)
	fr.WriteRSTStream(1, http2.ErrCodeCancel)
	fr.WriteGoAway(0, http2.ErrCodeNo, nil)
	f.Add(seed.Bytes())
	f.Add([]byte("\x00\x00\x00\x04\x00\x00\x00\x00\x00"))
	f.Add([]byte("\x00\x00\x05\x01\x04\x00\x00\x00\x02hello"))
	f.Fuzz(func(t *testing.T, data []byte) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		accepted := make(chan net.Conn, 1)
		go func() { c, _ := ln.Accept(); accepted <- c }()
		peer, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer peer.Close()
		conn := <-accepted
		if conn == nil {
			t.Fatal("accept failed")
		}
		var handlers sync.WaitGroup
		spawn := func(f func()) { handlers.Add(1); go func() { defer handlers.Done(); f() }() }
		echo := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(200)
			io.Copy(w, r.Body)
		})
		go func() { // the peer: preface, the fuzz bytes, then gone
			peer.Write([]byte(http2.ClientPreface))
			peer.Write(data)
			time.Sleep(10 * time.Millisecond)
			peer.Close()
		}()
		go io.Copy(io.Discard, peer)
		l, err := NewServer(conn, Config{KeepAlive: time.Second, PingTimeout: time.Second, Spawn: spawn}, echo)
		if err != nil {
			conn.Close()
			return
		}
		served := make(chan struct{})
		go func() { l.Serve(); close(served) }()
		select {
		case <-served:
		case <-time.After(5 * time.Second):
			t.Fatal("agent link did not end with its connection")
		}
		handlersDone := make(chan struct{})
		go func() { handlers.Wait(); close(handlersDone) }()
		select {
		case <-handlersDone:
		case <-time.After(5 * time.Second):
			t.Fatal("a handler outlived its link")
		}
	})
}

func TestLinkTruncatedHeadersRefuseOnlyThatStream(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPair(t, 0, 0)
	res := roundTripAsync(t, l, connectRequest(context.Background(), newTrackedBody(bytes.NewReader(nil))))
	h := a.next().(*http2.MetaHeadersFrame)
	// 80 KiB of headers in one block: past the 64 KiB list limit but not
	// twice past it, so the framer truncates instead of failing the link.
	a.hbuf.Reset()
	a.henc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
	for i := range 20 {
		a.henc.WriteField(hpack.HeaderField{Name: fmt.Sprintf("x-pad-%d", i), Value: strings.Repeat("p", 4<<10)})
	}
	block := a.hbuf.Bytes()
	first := min(len(block), 16<<10)
	a.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: h.StreamID, BlockFragment: block[:first]})
	for rest := block[first:]; len(rest) > 0; {
		n := min(len(rest), 16<<10)
		a.fr.WriteContinuation(h.StreamID, n == len(rest), rest[:n])
		rest = rest[n:]
	}
	r := <-res
	if r.err == nil {
		t.Fatal("a truncated header block was taken as an answer")
	}
	if !l.CanTakeNewRequest() {
		t.Fatal("the link died with the stream")
	}
}

func TestLinkRetiresWhenStreamIDsRunOut(t *testing.T) {
	checkNoLeaks(t)
	l, _ := newLinkPair(t, 0, 0)
	l.mu.Lock()
	l.nextID = maxStreamID + 2
	l.capacityChangedLocked() // as the last stream's open would
	l.mu.Unlock()
	if l.CanTakeNewRequest() {
		t.Fatal("a link with no stream IDs left takes new streams")
	}
	_, err := l.RoundTrip(connectRequest(context.Background(), newTrackedBody(bytes.NewReader(nil))))
	if !errors.Is(err, ErrGoAway) {
		t.Fatalf("RoundTrip: %v, want ErrGoAway (retried on another agent)", err)
	}
	// No tunnel open: closed at once, and the agent redials.
	waitLinkEnded(t, l, "a link with no stream IDs left and no tunnel stayed open")
}

// The client end facing a hostile peer (the server's end of an agent
// connection): PINGs it must answer, sent by a peer that never reads, end
// the connection once the default MaxQueuedControl answers wait.
func TestLinkPingFloodWithoutReading(t *testing.T) {
	checkNoLeaks(t)
	// A Unix socket: its buffers are small and fixed, where loopback TCP
	// would take megabytes of answers before the link has to queue any.
	l, a := newLinkPairOn(t, "unix", filepath.Join(t.TempDir(), "s"), 0, 0)
	a.conn.SetDeadline(time.Time{}) // no write deadline: a write cut short breaks the framing
	watchdog := time.AfterFunc(30*time.Second, func() { a.conn.Close() })
	defer watchdog.Stop()
	var n int
	for ; a.fr.WritePing(false, [8]byte{byte(n)}) == nil; n++ {
		if n%4096 == 0 {
			l.ctlMu.Lock()
			queued := len(l.ctlQueue)
			l.ctlMu.Unlock()
			if queued > DefaultMaxQueuedControl {
				t.Fatalf("%d control frames queued, limit %d", queued, DefaultMaxQueuedControl)
			}
		}
	}
	if !watchdog.Stop() {
		t.Fatal("still open after 30 s of PINGs sent without reading")
	}
	waitLinkEnded(t, l, "the link did not end after the flood")
	if !errors.Is(l.err(), errCalm) {
		t.Fatalf("link ended with %v, want ENHANCE_YOUR_CALM", l.err())
	}
	t.Logf("dropped after %d PINGs", n)
}

// stallLink makes the link's writer block: the fake agent sends PINGs
// without reading until a write of their acknowledgements has held the
// write lock for 50 ms (a Unix socket's buffers are small and fixed).
func stallLink(t *testing.T, l *Conn, a *fakeAgent) {
	t.Helper()
	a.conn.SetDeadline(time.Time{})
	deadline := time.Now().Add(10 * time.Second)
	for n := 0; l.wmu.takenFor(time.Now()) < 50*time.Millisecond; n++ {
		if time.Now().After(deadline) {
			t.Fatalf("the link's writer did not block after %d PINGs", n)
		}
		if n%64 == 0 {
			time.Sleep(5 * time.Millisecond)
		}
		if err := a.fr.WritePing(false, [8]byte{byte(n)}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestLinkStalledPeerTakesNoStreams: a peer that stops reading after
// making the link queue PING acknowledgements holds the write lock. A
// RoundTrip waits for it no longer than its context, and once the write
// has been under way for StallAfter the link takes no new stream and a
// RoundTrip gives up at once with ErrStalled, so a dial goes elsewhere.
func TestLinkStalledPeerTakesNoStreams(t *testing.T) {
	checkNoLeaks(t)
	t.Run("deadline", func(t *testing.T) {
		l, a := newLinkPairOn(t, "unix", filepath.Join(t.TempDir(), "s"), 0, 0)
		l.cfg.StallAfter = -1
		stallLink(t, l, a)
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		r := <-roundTripAsync(t, l, connectRequest(ctx, nil))
		if !errors.Is(r.err, context.DeadlineExceeded) {
			t.Fatalf("RoundTrip on a stalled link: %v, want the context's deadline", r.err)
		}
		if el := time.Since(start); el > 2*time.Second {
			t.Fatalf("RoundTrip returned after %v, its deadline was 200 ms", el)
		}
		if !l.CanTakeNewRequest() {
			t.Fatal("StallAfter < 0 marked the link stalled")
		}
	})
	t.Run("stall-after", func(t *testing.T) {
		l, a := newLinkPairOn(t, "unix", filepath.Join(t.TempDir(), "s"), 0, 0)
		l.cfg.StallAfter = 300 * time.Millisecond
		if !l.CanTakeNewRequest() {
			t.Fatal("a fresh link takes no stream")
		}
		stallLink(t, l, a)
		waitUntil(t, 5*time.Second, "the link is marked stalled", func() bool { return !l.CanTakeNewRequest() })
		if !l.Stalled() {
			t.Fatal("CanTakeNewRequest false but not Stalled")
		}
		start := time.Now()
		r := <-roundTripAsync(t, l, connectRequest(context.Background(), nil))
		if !errors.Is(r.err, ErrStalled) {
			t.Fatalf("RoundTrip on a stalled link: %v, want ErrStalled", r.err)
		}
		if el := time.Since(start); el > time.Second {
			t.Fatalf("ErrStalled after %v", el)
		}
	})
}

func waitUntil(t *testing.T, bound time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestLinkShutdownDoesNotWaitForStalledPeer: Shutdown waits for the open
// streams, but not on a connection whose writes do not drain: those
// streams cannot finish.
func TestLinkShutdownDoesNotWaitForStalledPeer(t *testing.T) {
	checkNoLeaks(t)
	l, a := newLinkPairOn(t, "unix", filepath.Join(t.TempDir(), "s"), 0, 0)
	l.cfg.StallAfter = 300 * time.Millisecond
	openAnswered(t, l, a) // a stream that stays open
	stallLink(t, l, a)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	err := l.Shutdown(ctx)
	if !errors.Is(err, ErrStalled) {
		t.Fatalf("Shutdown of a stalled link: %v, want ErrStalled", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("Shutdown returned after %v; the stall bound is 300 ms", el)
	}
}
