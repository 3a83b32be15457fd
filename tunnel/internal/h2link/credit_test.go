package h2link

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"golang.org/x/sys/unix"
)

// creditPeer is the serving end of a link as a test drives it: it answers
// every stream 200 and gives connection credit only when told, in grants
// of one frame, recording which stream each grant went to.
type creditPeer struct{ fr *http2.Framer }

func newCreditPeer(conn net.Conn) *creditPeer {
	p := &creditPeer{fr: http2.NewFramer(conn, conn)}
	p.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	return p
}

// answer writes a 200 for stream id.
func (p *creditPeer) answer(id uint32) error {
	var buf []byte
	enc := hpack.NewEncoder(&sliceWriter{&buf})
	enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
	return p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: buf, EndHeaders: true})
}

type sliceWriter struct{ b *[]byte }

func (w *sliceWriter) Write(p []byte) (int, error) { *w.b = append(*w.b, p...); return len(p), nil }

// endless is an upload that always has bytes.
type endless struct{ buf []byte }

func (e endless) Read(p []byte) (int, error) { return copy(p, e.buf), nil }
func (endless) Close() error                 { return nil }

// Thousands of writers may wait for the one connection window; each grant
// of credit must go to the one that has waited longest, not to whichever
// goroutine the scheduler runs first. Streams with endless uploads all
// wait for connection credit; the peer gives it one frame at a time, and
// no stream may be passed over while the others are served again and
// again.
func TestSendCreditFirstComeFirstServed(t *testing.T) {
	checkNoLeaks(t)
	const streams = 128
	// Every stream waits all along: between two of its grants the others
	// may each be served about once (a writer asks again at the tail once
	// its frame is written), twice or three times when its goroutine asked
	// again late on a busy machine. Four times is a stream passed over:
	// with one wake-up for every writer, the scheduler's choice let
	// streams wait six to ten rounds. A busy machine can delay one writer
	// past the bound once, so a second measurement decides.
	for try := 1; ; try++ {
		worst, who, served := creditGrantGaps(t, streams, 50*streams)
		t.Logf("%d grants among %d streams: the longest any stream waited was %d grants (stream %d)", 50*streams, streams, worst, who)
		if worst <= 4*streams {
			return
		}
		if try == 2 {
			t.Fatalf("stream %d waited %d grants between two of its own, while %d streams shared them: it was passed over (%s)", who, worst, streams, gapsOf(served))
		}
	}
}

// creditGrantGaps opens streams with endless uploads on a link whose peer
// gives connection credit one frame at a time, grants times, and returns
// the longest run of grants between two of one stream's.
func creditGrantGaps(t *testing.T, streams, grants int) (worst int, who uint32, served map[uint32][]int) {
	near, far := connPair(t, "tcp", "127.0.0.1:0")
	var wg sync.WaitGroup
	spawn := func(f func()) { wg.Add(1); go func() { defer wg.Done(); f() }() }
	l, err := NewClient(near, Config{Spawn: spawn})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var rts sync.WaitGroup
	defer func() { cancel(); l.Close(); far.Close(); rts.Wait(); wg.Wait() }()
	p := newCreditPeer(far)
	far.SetDeadline(time.Now().Add(2 * time.Minute))
	preface := make([]byte, len(http2.ClientPreface))
	if _, err := io.ReadFull(far, preface); err != nil {
		t.Fatal(err)
	}
	// Stream windows far larger than anything sent; the connection's stays
	// at the default 65,535 until the grants, which keep it small.
	if err := p.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64<<10)
	for range streams {
		rts.Add(1)
		go func() { defer rts.Done(); l.RoundTrip(connectRequest(ctx, endless{buf})) }() // ends with ctx or the link
	}
	frame := int(initialFrame) // the link's frames are the HTTP/2 default: the peer sent no MAX_FRAME_SIZE
	served = make(map[uint32][]int)
	answered, received, granted := 0, 0, 0
	window := initialWindow // what the link may still send
	for granted < grants {
		f, err := p.fr.ReadFrame()
		if err != nil {
			t.Fatalf("after %d grants: %v", granted, err)
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			if err := p.answer(f.StreamID); err != nil {
				t.Fatal(err)
			}
			answered++
		case *http2.DataFrame:
			n := len(f.Data())
			window -= n
			received += n
			if answered == streams && received > initialWindow {
				served[f.StreamID] = append(served[f.StreamID], granted)
			}
		}
		if window == 0 && answered == streams {
			// One frame of credit, once the last one was spent.
			if err := p.fr.WriteWindowUpdate(0, uint32(frame)); err != nil {
				t.Fatal(err)
			}
			window += frame
			granted++
		}
	}
	if len(served) != streams {
		t.Fatalf("%d of %d streams were ever served in %d grants", len(served), streams, grants)
	}
	for id, at := range served {
		for i := 1; i < len(at); i++ {
			if gap := at[i] - at[i-1]; gap > worst {
				worst, who = gap, id
			}
		}
	}
	return worst, who, served
}

func gapsOf(served map[uint32][]int) string {
	s := ""
	for id, at := range served {
		s += fmt.Sprintf("stream %d: %d grants; ", id, len(at))
	}
	return s
}

// socketPair is both ends of a Unix stream socket pair with small kernel
// buffers, so that writes into it are often partial or would block.
func socketPair() (*net.UnixConn, *net.UnixConn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		return nil, nil, err
	}
	var ends [2]*net.UnixConn
	for i, fd := range fds {
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 8<<10)
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 8<<10)
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			return nil, nil, err
		}
		ends[i] = c.(*net.UnixConn)
	}
	return ends[0], ends[1], nil
}

// socketUpload is the server's upload, as tunnel/server's is: it sends
// what its socket's peer writes, until EOF.
type socketUpload struct{ c *net.UnixConn }

func (u socketUpload) Read(p []byte) (int, error) { return u.c.Read(p) }
func (u socketUpload) Close() error               { return nil }
func (u socketUpload) SendTo(w io.Writer) error {
	buf := make([]byte, 32<<10)
	for {
		n, err := u.c.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return werr
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// Many tunnels, each echoing its bytes through both ends of a link as the
// product carries them (the client's socket, an upload, the link, a sink
// into the destination's socket, an echo, the handler writing back, a sink
// into the client's socket), with the connection windows held at their
// floor as a busy machine leaves them, small socket buffers (partial
// writes, writer goroutines), and every goroutine the link starts delayed
// by a few scheduler turns: every tunnel completes with every byte, and
// once the link is quiet no credit is owed for a byte delivered.
func TestLinkTunnelsBothWaysUnderAdverseScheduling(t *testing.T) {
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			linkTunnelsBothWays(t, 200, 128<<10)
		})
	}
}

func linkTunnelsBothWays(t *testing.T, tunnels, size int) {
	checkNoLeaks(t)
	near, far := connPair(t, "tcp", "127.0.0.1:0")
	var wg sync.WaitGroup
	var turn atomic.Uint32
	spawn := func(f func()) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range turn.Add(1) % 7 { // delayed writer goroutines and handlers
				runtime.Gosched()
			}
			f()
		}()
	}
	// The agent's end: each tunnel's bytes go into a destination socket
	// whose far side echoes them; the handler writes back what it reads.
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mine, dest, err := socketPair()
		if err != nil {
			panic(err) // resets this stream: its client fails the test
		}
		defer mine.Close()
		wg.Add(1)
		go func() { // the destination: an echo, ended by its socket's EOF
			defer wg.Done()
			defer dest.Close()
			io.Copy(dest, dest)
		}()
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		d := r.Body.(*Body).DeliverTo(mine, func(err error) error {
			if err == nil {
				mine.CloseWrite()
			}
			return err
		})
		io.Copy(w, mine)
		<-d.Done()
	})
	var srv *Conn
	ready := make(chan error, 1)
	go func() {
		var err error
		srv, err = NewServer(far, Config{Spawn: spawn, MaxConcurrentStreams: uint32(tunnels)}, handler)
		ready <- err
	}()
	cli, err := NewClient(near, Config{Spawn: spawn})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-ready; err != nil {
		t.Fatal(err)
	}
	wg.Add(1)
	go func() { defer wg.Done(); srv.Serve() }()
	defer func() { cli.Close(); srv.Close(); near.Close(); far.Close(); wg.Wait() }()
	// Both connection windows at their floor for good, as a busy machine's
	// long round trips leave them.
	for _, l := range []*Conn{cli, srv} {
		l.mu.Lock()
		l.bdp.on = false
		l.setRecvTargetLocked(minConnWindow)
		l.mu.Unlock()
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pat := make([]byte, size+256)
	for i := range pat {
		pat[i] = byte(i * 7 / 5)
	}
	errs := make(chan error, tunnels)
	var clients sync.WaitGroup
	for i := range tunnels {
		clients.Add(1)
		go func() {
			defer clients.Done()
			errs <- echoThrough(ctx, cli, pat[i%256:i%256+size])
		}()
	}
	clients.Wait()
	close(errs)
	failed := 0
	for err := range errs {
		if err != nil {
			if failed++; failed <= 3 {
				t.Error(err)
			}
		}
	}
	if failed > 0 {
		t.Fatalf("%d of %d tunnels failed", failed, tunnels)
	}
	// Quiet now: what each end may still send is what the other lets it,
	// and no credit for a byte received is held back past the refill point.
	waitUntil(t, 10*time.Second, "the link is quiet", func() bool {
		cli.mu.Lock()
		srv.mu.Lock()
		defer srv.mu.Unlock()
		defer cli.mu.Unlock()
		return len(cli.streams) == 0 && len(srv.streams) == 0 &&
			cli.sendWindow.avail() == srv.recvWindow.avail() && srv.sendWindow.avail() == cli.recvWindow.avail()
	})
	for name, l := range map[string]*Conn{"client": cli, "server": srv} {
		l.mu.Lock()
		if l.recvWindow.avail()+l.recvUnacked != int64(l.recvTarget) || l.recvUnacked >= refillAt(l.recvTarget) {
			t.Errorf("%s end: receive window %d and %d unreturned, for a target of %d: credit owed", name, l.recvWindow.avail(), l.recvUnacked, l.recvTarget)
		}
		l.mu.Unlock()
	}
}

// echoThrough opens a tunnel the way the server does (an upload from the
// client's socket, the answer delivered into it) and echoes pat through it.
func echoThrough(ctx context.Context, l *Conn, pat []byte) error {
	app, mine, err := socketPair()
	if err != nil {
		return err
	}
	defer app.Close()
	defer mine.Close()
	resp, err := l.RoundTrip(connectRequest(ctx, socketUpload{mine}))
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	d := resp.Body.(*Body).DeliverTo(mine, func(error) error { return nil })
	werr := make(chan error, 1)
	go func() {
		_, err := app.Write(pat)
		app.CloseWrite()
		werr <- err
	}()
	got := make([]byte, len(pat))
	app.SetReadDeadline(time.Now().Add(2 * time.Minute))
	if _, err := io.ReadFull(app, got); err != nil {
		return fmt.Errorf("read the echo: %w (%d bytes delivered)", err, d.Written())
	}
	if err := <-werr; err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if !bytes.Equal(got, pat) {
		return errors.New("the echo differs from what was sent")
	}
	<-d.Done()
	return nil
}
