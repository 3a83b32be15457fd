package h2link

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// stallRecorder keeps what OnCreditStall is told.
type stallRecorder struct{ ch chan CreditStall }

func newStallRecorder() *stallRecorder { return &stallRecorder{ch: make(chan CreditStall, 64)} }

func (r *stallRecorder) tell(s CreditStall) {
	select {
	case r.ch <- s:
	default:
	}
}

// none fails the test if any stall was told.
func (r *stallRecorder) none(t *testing.T, who string) {
	t.Helper()
	select {
	case s := <-r.ch:
		t.Fatalf("%s told of a credit stall: %v", who, s.LogArgs())
	default:
	}
}

// waitStall runs l's credit checks until r is told of a stall, for at
// most 10 s.
func waitStall(t *testing.T, l *Conn, r *stallRecorder) CreditStall {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		l.CheckCredit(0)
		select {
		case s := <-r.ch:
			return s
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("no credit stall told within 10 s")
		}
	}
}

// checkFor runs l's credit checks for d, for a stall that must not come.
func checkFor(l *Conn, d time.Duration) {
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		l.CheckCredit(0)
	}
}

// A peer that reads every frame and never returns connection credit
// holds the link's writer in the send queue once the connection's 65,535
// bytes are spent, though its stream has credit: a credit stall of kind
// connection_credit, told once with its figures by the keepalive timer's
// checks, and counted; the writer's wait shows in the status. Credit
// arriving lets the upload finish and ends the wait.
func TestCreditStallConnectionCreditTold(t *testing.T) {
	checkNoLeaks(t)
	const bound = 200 * time.Millisecond
	rec := newStallRecorder()
	near, far := connPair(t, "unix", filepath.Join(t.TempDir(), "s"))
	var wg sync.WaitGroup
	spawn := func(f func()) { wg.Add(1); go func() { defer wg.Done(); f() }() }
	l, err := NewClient(near, Config{KeepAlive: 20 * time.Millisecond, PingTimeout: 10 * time.Second,
		CreditStallAfter: bound, OnCreditStall: rec.tell, Spawn: spawn})
	if err != nil {
		t.Fatal(err)
	}
	a := &fakeAgent{t: t, conn: far, fr: http2.NewFramer(far, far)}
	a.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	a.henc = hpack.NewEncoder(&a.hbuf)
	preface := make([]byte, len(http2.ClientPreface))
	far.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(far, preface); err != nil {
		t.Fatal(err)
	}
	// Stream credit to spare; the connection keeps its first 65,535 bytes.
	a.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20})

	const size = 256 << 10
	res := roundTripAsync(t, l, connectRequest(context.Background(), newTrackedBody(bytes.NewReader(make([]byte, size)))))
	h := a.next().(*http2.MetaHeadersFrame)
	a.respond(h.StreamID, "200", false)
	if r := <-res; r.err != nil {
		t.Fatal(r.err)
	}
	// The peer reads everything and answers PINGs, never with credit
	// until the test gives it.
	var wmu sync.Mutex
	write := func(f func(*http2.Framer) error) { wmu.Lock(); f(a.fr); wmu.Unlock() }
	var got int
	ended := make(chan struct{})
	read := make(chan struct{})
	far.SetDeadline(time.Time{})
	go func() {
		defer close(read)
		for {
			f, err := a.fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.PingFrame:
				if !f.IsAck() {
					write(func(fr *http2.Framer) error { return fr.WritePing(true, f.Data) })
				}
			case *http2.DataFrame:
				got += len(f.Data())
				if f.StreamEnded() {
					close(ended)
				}
			}
		}
	}()
	defer func() { l.Close(); far.Close(); <-read; wg.Wait() }()

	var s CreditStall
	select {
	case s = <-rec.ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("no credit stall told 10 s after the connection's credit ran out (bound %v); status %+v", bound, l.CheckCredit(4))
	}
	t.Logf("told: %v", s.LogArgs())
	if s.Kind != StallConnectionCredit || s.StreamID != h.StreamID || s.For < bound || s.Waited < bound ||
		s.ConnSendWindow > 0 || s.SendWindow <= 0 || s.Writers != 1 {
		t.Errorf("stall %+v: want connection_credit on stream %d, seen and waited for %v or more, no connection credit, stream credit, one writer", s, h.StreamID, bound)
	}
	checkFor(l, 3*bound)
	rec.none(t, "a second check of the same stall")
	cs := l.CheckCredit(4)
	if cs.Stalls != 1 || cs.Waiting != 1 || len(cs.Longest) != 1 || cs.Longest[0].StreamID != h.StreamID ||
		!cs.Longest[0].ForConnection || time.Since(cs.Longest[0].Since) < bound {
		t.Errorf("status %+v: want one stall, stream %d waiting for the connection's credit for %v or more", cs, h.StreamID, bound)
	}

	write(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, 1<<20) })
	select {
	case <-ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the upload did not finish once credit came")
	}
	if cs := l.CheckCredit(4); cs.Waiting != 0 || cs.Stalls != 1 {
		t.Errorf("status once the upload ended: %+v, want no writer waiting and the one stall", cs)
	}
	rec.none(t, "the link after credit came")
	if got != size {
		t.Errorf("the peer got %d bytes of %d", got, size)
	}
}

// A reader that does not read holds its stream's writer waiting for
// stream credit: flow control at work, not a credit stall, at either end.
// Once the reader reads, everything arrives, and no stall is told.
func TestCreditStallNotForSlowReader(t *testing.T) {
	checkNoLeaks(t)
	const bound = 100 * time.Millisecond
	near, far := connPair(t, "unix", filepath.Join(t.TempDir(), "s"))
	var wg sync.WaitGroup
	spawn := func(f func()) { wg.Add(1); go func() { defer wg.Done(); f() }() }
	cliRec, srvRec := newStallRecorder(), newStallRecorder()
	const size = 4 << 20
	release, drained := make(chan struct{}), make(chan int64, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done(): // the test ended early
			return
		}
		n, _ := io.Copy(io.Discard, r.Body)
		drained <- n
	})
	cfg := Config{KeepAlive: 20 * time.Millisecond, PingTimeout: 10 * time.Second, CreditStallAfter: bound, Spawn: spawn}
	cliCfg, srvCfg := cfg, cfg
	cliCfg.OnCreditStall, srvCfg.OnCreditStall = cliRec.tell, srvRec.tell
	cli, err := NewClient(near, cliCfg)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := NewServer(far, srvCfg, h)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { srv.Serve(); close(served) }()
	defer func() { cli.Close(); srv.Close(); <-served; wg.Wait() }()

	r := <-roundTripAsync(t, cli, connectRequest(context.Background(), newTrackedBody(bytes.NewReader(make([]byte, size)))))
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.resp.Body.Close()
	waitUntil(t, 10*time.Second, "the writer waits for its stream's credit for three bounds", func() bool {
		srv.CheckCredit(0)
		cs := cli.CheckCredit(1)
		return len(cs.Longest) == 1 && !cs.Longest[0].ForConnection && time.Since(cs.Longest[0].Since) > 3*bound
	})
	cliRec.none(t, "the sender")
	srvRec.none(t, "the receiver")
	close(release)
	select {
	case n := <-drained:
		if n != size {
			t.Fatalf("the reader got %d bytes of %d", n, size)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the upload did not finish once the reader read")
	}
	for _, l := range []*Conn{cli, srv} {
		if cs := l.CheckCredit(1); cs.Stalls != 0 || cs.Waiting != 0 {
			t.Errorf("status %+v: want no stall, no writer waiting", cs)
		}
	}
	cliRec.none(t, "the sender")
	srvRec.none(t, "the receiver")
}

// Credit owed and not returned, the stream's and the connection's (made
// here by hand: the rules that return it leave no path to it), is a
// credit stall of kind credit_owed once a check has seen it for the
// bound: told once each, with the figures, and counted.
func TestCreditStallOwedTold(t *testing.T) {
	checkNoLeaks(t)
	const bound = 100 * time.Millisecond
	const size = 100 << 10
	rec := newStallRecorder()
	read, done := make(chan struct{}), make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadFull(r.Body, make([]byte, size))
		close(read)
		<-done
	})
	l, c := servingPair(t, Config{CreditStallAfter: bound, OnCreditStall: rec.tell}, h)
	defer close(done)
	c.request(1, false)
	c.fr.WriteData(1, false, make([]byte, size/2))
	c.fr.WriteData(1, false, make([]byte, size/2))
	select {
	case <-read:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not read the upload")
	}
	checkFor(l, 2*bound)
	rec.none(t, "a stream whose reader read it all")

	l.mu.Lock()
	st := l.streams[1]
	st.rmu.Lock()
	st.recvWindow = window{0} // what the peer sent was read, and its credit lost
	st.unacked = int64(st.recvSize)
	win := int64(st.recvSize)
	st.rmu.Unlock()
	l.recvUnacked += l.recvWindow.avail()
	l.recvWindow = window{0}
	target := int64(l.recvTarget)
	l.mu.Unlock()

	told := map[uint32]CreditStall{}
	for range 2 {
		s := waitStall(t, l, rec)
		t.Logf("told: %v", s.LogArgs())
		told[s.StreamID] = s
	}
	if s := told[1]; s.Kind != StallCreditOwed || s.For < bound || s.RecvWindow != 0 || s.Unacked != win || s.Queued != 0 || s.WindowSize != win {
		t.Errorf("stream 1: %+v, want credit_owed for %v or more, its whole window owed, nothing queued", s, bound)
	}
	if s, ok := told[0]; !ok || s.Kind != StallCreditOwed || s.RecvWindow != 0 || s.Unacked != target || s.WindowSize != target {
		t.Errorf("connection: %+v, want credit_owed, its whole window owed", s)
	}
	checkFor(l, 2*bound)
	rec.none(t, "a second check of the same stalls")
	if cs := l.CheckCredit(0); cs.Stalls != 2 {
		t.Errorf("%d stalls counted, want 2", cs.Stalls)
	}
}
