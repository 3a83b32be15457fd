//lint:file-ignore SA1019 the test peer is x/net/http2's client: HTTP/2 with prior knowledge on a socket the test holds, as kube-apiserver's gRPC client speaks it.

package h2link

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/sys/unix"
)

// echoUntilStopped echoes the request body as it arrives; once the read
// loop stopped for a freeze and the body is drained it detaches the stream
// and reports what it echoed. After the body's end it returns.
func echoUntilStopped(w http.ResponseWriter, r *http.Request, stopped chan<- int64) {
	var n int64
	buf := make([]byte, 4096)
	w.(http.Flusher).Flush() // the head, so the client's RoundTrip returns
	for {
		m, err := r.Body.Read(buf)
		if m > 0 {
			w.Write(buf[:m])
			w.(http.Flusher).Flush()
			n += int64(m)
		}
		if errors.Is(err, ErrReadStopped) {
			Detach(w)
			stopped <- n
			return
		}
		if err != nil {
			w.Header().Set(http.TrailerPrefix+"Echoed", fmt.Sprint(n))
			return
		}
	}
}

// dupConn is a second connection on c's socket, as the next process gets.
func dupConn(t *testing.T, c net.Conn) net.Conn {
	t.Helper()
	rc, err := c.(*net.UnixConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var fd int
	rc.Control(func(s uintptr) { fd, err = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 3) })
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "dup")
	defer f.Close()
	nc, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	return nc
}

// TestFreezeResume: a stream of Go's HTTP/2 client (x/net) echoed by a
// freezable serving end keeps going across a freeze and a rebuild on a
// duplicate of the socket, with the state passed through JSON; every
// byte comes back once and in order, and the client's later requests
// (whose headers refer to its HPACK table) are served on the rebuilt
// connection.
func TestFreezeResume(t *testing.T) {
	checkNoLeaks(t)
	dir := t.TempDir()
	client, server := connPair(t, "unix", dir+"/s")
	defer client.Close()

	stopped := make(chan int64, 1)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { echoUntilStopped(w, r, stopped) })
	cfg := Config{Freezable: true}
	tr := &http2.Transport{AllowHTTP: true}
	cc, err := tr.NewClientConn(client) // its preface first: NewServer reads it
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	l, err := NewServer(server, cfg, handler)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { l.Serve(); close(served) }()

	pr, pw := io.Pipe()
	req, _ := http.NewRequest(http.MethodPost, "http://x/echo", pr)
	req.Header.Set("X-Long-Header", strings.Repeat("h", 200)) // indexed by the client's HPACK encoder
	resp, err := cc.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	var sent bytes.Buffer
	var wmu sync.Mutex
	write := func(p []byte) {
		wmu.Lock()
		defer wmu.Unlock()
		if _, err := pw.Write(p); err != nil {
			t.Error(err)
		}
		sent.Write(p)
	}
	got := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(resp.Body)
		got <- b
	}()
	// Bytes flow while the server freezes.
	stopWriting := make(chan struct{})
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		for i := 0; ; i++ {
			select {
			case <-stopWriting:
				return
			default:
			}
			write([]byte(fmt.Sprintf("chunk %d %s|", i, strings.Repeat("x", i%5000))))
			time.Sleep(100 * time.Microsecond)
		}
	}()
	time.Sleep(200 * time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := l.StopReading(ctx); err != nil {
		t.Fatal(err)
	}
	echoed := <-stopped
	// The handler has detached; its return (which Freeze needs, as
	// ErrNotAtRest says) may take a moment more: WaitAtRest waits for it.
	if err := l.WaitAtRest(ctx); err != nil {
		t.Fatal(err)
	}
	frozen, err := l.Freeze()
	if err != nil {
		t.Fatal(err)
	}
	next := dupConn(t, server)
	server.Close()
	<-served
	data, err := json.Marshal(frozen)
	if err != nil {
		t.Fatal(err)
	}
	var f2 Frozen
	if err := json.Unmarshal(data, &f2); err != nil {
		t.Fatal(err)
	}
	if len(f2.Streams) != 1 || len(f2.HeaderFrames) != 1 {
		t.Fatalf("frozen: %d streams, %d header frames; want 1, 1", len(f2.Streams), len(f2.HeaderFrames))
	}

	resumedStop := make(chan int64, 1)
	l2, err := ResumeServer(next, cfg, &f2, handler, func(w http.ResponseWriter, r *http.Request) { echoUntilStopped(w, r, resumedStop) })
	if err != nil {
		t.Fatal(err)
	}
	served2 := make(chan struct{})
	go func() { l2.Serve(); close(served2) }()
	time.Sleep(200 * time.Millisecond) // bytes flow on the rebuilt connection
	close(stopWriting)
	<-writerDone
	pw.Close()
	body := <-got
	if !bytes.Equal(body, sent.Bytes()) {
		t.Fatalf("echo: %d bytes back of %d sent (%d echoed before the freeze); first difference at %d", len(body), sent.Len(), echoed, firstDiff(body, sent.Bytes()))
	}
	if tr := resp.Trailer.Get("Echoed"); tr == "" {
		t.Errorf("no trailers after the resume: %v", resp.Trailer)
	}
	t.Logf("%d bytes echoed, %d of them before the freeze", len(body), echoed)

	// A new request on the rebuilt connection: its headers refer to the
	// client's HPACK table, and the answer's to a table this end emptied.
	for i := range 3 {
		req2, _ := http.NewRequest(http.MethodPost, "http://x/echo", strings.NewReader(fmt.Sprint("again ", i)))
		req2.Header.Set("X-Long-Header", strings.Repeat("h", 200))
		resp2, err := cc.RoundTrip(req2)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp2.Body)
		resp2.Body.Close()
		if string(b) != fmt.Sprint("again ", i) {
			t.Fatalf("request %d after the resume: %q", i, b)
		}
	}
	cc.Close()
	l2.Close()
	<-served2
	next.Close()
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// TestFreezeRefusedPastHeaderBound: the header blocks a freezable end
// keeps for a freeze are bounded (maxFrozenHeaders); a peer that sends
// more costs no more memory, and its connection cannot be frozen.
func TestFreezeRefusedPastHeaderBound(t *testing.T) {
	checkNoLeaks(t)
	client, server := connPair(t, "unix", t.TempDir()+"/s")
	defer client.Close()
	defer server.Close()
	tr := &http2.Transport{AllowHTTP: true}
	cc, err := tr.NewClientConn(client)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	l, err := NewServer(server, Config{Freezable: true}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { l.Serve(); close(served) }()
	for i := range 40 { // 40 blocks of about 3 KiB, each new to the client's HPACK table
		req, _ := http.NewRequest(http.MethodGet, "http://x/", nil)
		req.Header.Set(fmt.Sprintf("X-Big-%d", i), strings.Repeat(fmt.Sprint(i%10), 3000))
		resp, err := cc.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := l.StopReading(ctx); err != nil {
		t.Fatal(err)
	}
	if l.fread.frames != nil || !l.fread.overflow {
		t.Errorf("kept %d header frames past the bound", len(l.fread.frames))
	}
	if _, err := l.Freeze(); err == nil || !strings.Contains(err.Error(), "too many header blocks") {
		t.Errorf("Freeze: %v, want a refusal", err)
	}
	l.Close()
	<-served
}
