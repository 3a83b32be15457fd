package agent

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// Data integrity under load and under faults: every byte that goes in
// comes out, in order, or the tunnel ends in a way the client can see.

// randStream is an endless stream of random bytes (AES-CTR keystream
// under a random key), fast enough to feed hundreds of MiB through a
// tunnel without the generator being the bottleneck.
type randStream struct{ s cipher.Stream }

func newRandStream(t testing.TB) *randStream {
	key, iv := make([]byte, 16), make([]byte, 16)
	rand.Read(key)
	rand.Read(iv)
	b, err := aes.NewCipher(key)
	if err != nil {
		t.Fatal(err)
	}
	return &randStream{s: cipher.NewCTR(b, iv)}
}

func (r *randStream) Read(p []byte) (int, error) {
	clear(p)
	r.s.XORKeyStream(p, p)
	return len(p), nil
}

// sendRandom writes n random bytes to w and returns their SHA-256.
func sendRandom(t testing.TB, w io.Writer, n int64) ([]byte, error) {
	h := sha256.New()
	_, err := io.CopyBuffer(io.MultiWriter(w, h), io.LimitReader(newRandStream(t), n), make([]byte, 256<<10))
	return h.Sum(nil), err
}

// digestDest is a destination that reads a 16-byte request (how many bytes
// the client will send, how many it wants back), then at the same time
// sends that many random bytes and hashes what it receives. It reports
// both digests on results, keyed by the request's first field's tag.
type digestResult struct {
	recvN      int64
	recv, sent []byte
	recvErr    error
	wantRecvN  int64
	sentN      int64
	sentErr    error
}

func digestDest(t *testing.T, results chan<- digestResult) string {
	return tunneltest.ServeTCP(t, func(c net.Conn) {
		var hdr [16]byte
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			results <- digestResult{recvErr: fmt.Errorf("read header: %w", err)}
			return
		}
		up, down := int64(binary.BigEndian.Uint64(hdr[:8])), int64(binary.BigEndian.Uint64(hdr[8:]))
		var r digestResult
		r.wantRecvN = up
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.sent, r.sentErr = sendRandom(t, c, down)
			r.sentN = down
		}()
		h := sha256.New()
		r.recvN, r.recvErr = io.CopyBuffer(h, c, make([]byte, 256<<10))
		r.recv = h.Sum(nil)
		wg.Wait()
		// Half-close after the upload ended (a destination may also
		// half-close first: TestDestinationHalfCloseKeepsUpload).
		c.(*net.TCPConn).CloseWrite()
		results <- r
	})
}

// transferSize is the per-direction total for the bulk integrity test:
// 256 MiB by default; KONNECTIVITY_BIG_TRANSFER=1 makes it 1 GiB, and
// KONNECTIVITY_TRANSFER_MIB sets it exactly.
func transferSize(t *testing.T) int64 {
	if s := os.Getenv("KONNECTIVITY_TRANSFER_MIB"); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatalf("KONNECTIVITY_TRANSFER_MIB: %v", err)
		}
		return n << 20
	}
	if os.Getenv("KONNECTIVITY_BIG_TRANSFER") != "" {
		return 1 << 30
	}
	if testing.Short() {
		return 32 << 20
	}
	return 256 << 20
}

// 4 tunnels at once, each carrying a quarter of the total in each direction
// at the same time; both ends hash what they saw.
func TestIntegrityBulkBothDirections(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	total := transferSize(t)
	const tunnels = 4
	per := total / tunnels
	e := newEnv(t, nil)
	a := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	results := make(chan digestResult, tunnels)
	dest := digestDest(t, results)

	start := time.Now()
	type clientResult struct {
		sent, recv []byte
		recvN      int64
		err        error
	}
	clients := make(chan clientResult, tunnels)
	for range tunnels {
		go func() {
			conn, br, resp := e.Connect(dest)
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(5 * time.Minute))
			if resp.StatusCode != 200 {
				clients <- clientResult{err: fmt.Errorf("status %d", resp.StatusCode)}
				return
			}
			var hdr [16]byte
			binary.BigEndian.PutUint64(hdr[:8], uint64(per))
			binary.BigEndian.PutUint64(hdr[8:], uint64(per))
			sentCh := make(chan []byte, 1)
			go func() {
				conn.Write(hdr[:])
				sum, err := sendRandom(t, conn, per)
				if err != nil {
					sum = nil
				}
				conn.(*net.UnixConn).CloseWrite()
				sentCh <- sum
			}()
			h := sha256.New()
			n, err := io.CopyBuffer(h, br, make([]byte, 256<<10))
			clients <- clientResult{sent: <-sentCh, recv: h.Sum(nil), recvN: n, err: err}
		}()
	}
	var cs []clientResult
	var ds []digestResult
	for range tunnels {
		cs = append(cs, <-clients)
	}
	for range tunnels {
		ds = append(ds, <-results)
	}
	el := time.Since(start)
	// Match each client with its destination by digest: tunnels are
	// independent, so each client's upload digest must equal exactly one
	// destination's download digest and vice versa.
	for i, c := range cs {
		if c.err != nil || c.sent == nil {
			t.Fatalf("client %d: %v (sent digest %x)", i, c.err, c.sent)
		}
		if c.recvN != per {
			t.Errorf("client %d received %d bytes, want %d", i, c.recvN, per)
		}
		found := false
		for _, d := range ds {
			if bytes.Equal(d.recv, c.sent) && bytes.Equal(d.sent, c.recv) {
				found = true
				if d.recvN != per {
					t.Errorf("destination received %d bytes, want %d", d.recvN, per)
				}
			}
		}
		if !found {
			t.Errorf("client %d: no destination saw its upload digest %x and sent its download digest %x", i, c.sent, c.recv)
		}
	}
	mib := float64(2*total) / (1 << 20)
	t.Logf("%d tunnels, %d MiB each way in total: %.0f MiB in %s (%.0f MiB/s), agent bytes to/from dest %d/%d",
		tunnels, total>>20, mib, el.Round(time.Millisecond), mib/el.Seconds(), a.Stats.BytesToDest.Load(), a.Stats.BytesFromDest.Load())
}

// A tunnel that carries nothing, and one that carries exactly one byte each
// way, end cleanly with exactly that.
func TestIntegrityZeroAndOneByte(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	got := make(chan []byte, 4)
	dest := tunneltest.ServeTCP(t, func(c net.Conn) {
		b, _ := io.ReadAll(c)
		got <- b
		c.Write(b) // echo exactly what came, after the client's half-close
	})
	for _, payload := range [][]byte{nil, {0x5a}} {
		conn, br, resp := e.Connect(dest)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		if len(payload) > 0 {
			if _, err := conn.Write(payload); err != nil {
				t.Fatal(err)
			}
		}
		conn.(*net.UnixConn).CloseWrite()
		back, err := io.ReadAll(br)
		conn.Close()
		if err != nil {
			t.Fatalf("%d-byte tunnel: read: %v", len(payload), err)
		}
		if !bytes.Equal(back, payload) {
			t.Fatalf("%d-byte tunnel: echoed %q, want %q", len(payload), back, payload)
		}
		select {
		case d := <-got:
			if !bytes.Equal(d, payload) {
				t.Fatalf("%d-byte tunnel: destination got %q", len(payload), d)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%d-byte tunnel: destination never saw EOF", len(payload))
		}
	}
}

// A destination that resets its connection (SO_LINGER 0, then close) in
// the middle of a transfer. What the client can observe on the Unix socket,
// which has no RST of its own:
//   - every byte it receives is an exact prefix of what the destination
//     wrote, and fewer than the destination announced;
//   - the read ends (EOF, or ECONNRESET if the server had unread client
//     bytes when it closed) within a bound;
//   - the server closed the socket completely, not with a half-close: a
//     write after the end fails (EPIPE/ECONNRESET). After a clean end the
//     same write succeeds, because the client may still send. That write
//     is how a client tells a reset from a clean end.
func TestDestinationResetIsAbruptForClient(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	a := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	const announced, before = 8 << 20, 1 << 20
	stream := newRandStream(t)
	data := make([]byte, announced)
	stream.Read(data)
	var clientGot atomic.Int64 // bytes the client has read in observe
	reset := tunneltest.ServeTCP(t, func(c net.Conn) {
		c.Write(data[:before])
		// The bytes reach the client before the reset.
		for deadline := time.Now().Add(10 * time.Second); clientGot.Load() < before && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
		c.(*net.TCPConn).SetLinger(0)
		c.Close() // RST
	})
	clean := tunneltest.ServeTCP(t, func(c net.Conn) {
		c.Write(data[:before])
		c.(*net.TCPConn).CloseWrite() // FIN: a clean end
		io.Copy(io.Discard, c)
	})

	observe := func(dest string, wantWriteErr bool) (got []byte, took time.Duration, readErr, writeErr error) {
		clientGot.Store(0)
		conn, br, resp := e.Connect(dest)
		defer conn.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		start := time.Now()
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		got, readErr = io.ReadAll(io.TeeReader(br, countWriter{&clientGot}))
		took = time.Since(start)
		// Probe the write side. Where a failure is expected, probe until
		// it comes (the server may still be closing), within a bound.
		conn.SetWriteDeadline(time.Now().Add(2 * time.Second))
		_, writeErr = conn.Write([]byte("after the end"))
		for deadline := time.Now().Add(2 * time.Second); wantWriteErr && writeErr == nil && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
			_, writeErr = conn.Write([]byte("after the end"))
		}
		return
	}

	got, took, readErr, writeErr := observe(reset, true)
	if tunneltest.IsTimeout(readErr) {
		t.Fatalf("reset: the client read never ended (%v)", readErr)
	}
	if readErr != nil && !errors.Is(readErr, syscall.ECONNRESET) {
		t.Fatalf("reset: read error %v, want EOF or ECONNRESET", readErr)
	}
	if len(got) >= announced || !bytes.Equal(got, data[:len(got)]) {
		t.Fatalf("reset: client got %d bytes (prefix intact: %v), want a strict prefix of %d", len(got), bytes.Equal(got, data[:min(len(got), announced)]), announced)
	}
	if writeErr == nil {
		t.Fatal("reset: the socket was only half-closed; a write after the end succeeded, so the client cannot tell the reset from a clean end")
	}
	if !errors.Is(writeErr, syscall.EPIPE) && !errors.Is(writeErr, syscall.ECONNRESET) {
		t.Fatalf("reset: write after the end: %v, want EPIPE or ECONNRESET", writeErr)
	}
	t.Logf("reset: client got %d of %d bytes (intact prefix), read ended with %v after %s, then write: %v; agent resets counted %d",
		len(got), announced, readErr, took.Round(time.Millisecond), writeErr, a.metrics.resets.Value())

	// A clean end looks the same on the read side: EOF after exactly what
	// was sent. Only the byte count (application framing such as an HTTP
	// Content-Length) or a later write tells the two apart; over a Unix
	// socket there is no reset to pass on. After a clean end the tunnel is
	// half-closed and the client may go on sending (see
	// TestDestinationHalfCloseKeepsUpload).
	got, _, readErr, writeErr = observe(clean, false)
	if readErr != nil || !bytes.Equal(got, data[:before]) {
		t.Fatalf("clean end: got %d bytes, err %v", len(got), readErr)
	}
	t.Logf("clean end: client got all %d bytes then EOF; write after the end: %v", before, writeErr)
}

// A destination that half-closes (sends everything, FIN) while the client
// is still uploading: the client reads EOF, and everything it sends after
// that still reaches the destination, followed by a clean end when the
// client half-closes too. (With Go's HTTP/2 server the agent could not keep
// reading a stream after ending its response, and the rest was lost.)
func TestDestinationHalfCloseKeepsUpload(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	type seen struct {
		n   int64
		sum []byte
		err error
	}
	results := make(chan seen, 1)
	dest := tunneltest.ServeTCP(t, func(c net.Conn) {
		io.WriteString(c, "ready\n")
		c.(*net.TCPConn).CloseWrite() // done talking; keeps reading
		h := sha256.New()
		n, err := io.Copy(h, c)
		results <- seen{n, h.Sum(nil), err}
	})
	conn, br, resp := e.Connect(dest)
	defer conn.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if line, err := br.ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("greeting %q %v", line, err)
	}
	if rest, err := io.ReadAll(br); err != nil || len(rest) != 0 {
		t.Fatalf("after the destination's FIN the client read %q, %v; want a clean EOF", rest, err)
	}
	const n = 4 << 20
	sum, werr := sendRandom(t, conn, n)
	if werr != nil {
		t.Fatalf("upload after the destination's FIN: %v", werr)
	}
	conn.(*net.UnixConn).CloseWrite()
	select {
	case r := <-results:
		if r.err != nil || r.n != n || !bytes.Equal(r.sum, sum) {
			t.Fatalf("destination read %d of %d bytes (end %v, checksum match %v)", r.n, n, r.err, bytes.Equal(r.sum, sum))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("destination never saw the end of the upload")
	}
}

// A client that disappears in the middle of a download: the agent closes
// its destination connection promptly, and nothing stays open anywhere.
func TestClientGoneMidStreamClosesDestination(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	a := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	closed := make(chan time.Time, 1)
	dest := tunneltest.ServeTCP(t, func(c net.Conn) {
		buf := make([]byte, 64<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				closed <- time.Now()
				return
			}
		}
	})
	conn, br, resp := e.Connect(dest)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if _, err := io.CopyN(io.Discard, br, 4<<20); err != nil {
		t.Fatal(err)
	}
	gone := time.Now()
	conn.Close()
	const bound = 3 * time.Second
	select {
	case at := <-closed:
		t.Logf("destination connection closed %s after the client went away", at.Sub(gone).Round(time.Millisecond))
	case <-time.After(bound):
		t.Fatalf("destination still open %s after the client went away", bound)
	}
	tunneltest.WaitUntil(t, func() bool { return a.Stats.Tunnels.Load() == 0 && e.frontOpen(t) == 0 },
		"tunnel closed at the agent and the server")
}

// Shutdown (what SIGHUP and SIGTERM run) lets a transfer in progress
// finish: every byte arrives, both ways, within the grace period.
func TestShutdownLetsTransfersFinish(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	results := make(chan digestResult, 4)
	dest := digestDest(t, results)
	const per = 8 << 20 // still in flight when Shutdown starts, even under -race
	const tunnels = 4
	type clientResult struct {
		sent, recv []byte
		recvN      int64
		err        error
	}
	clients := make(chan clientResult, tunnels)
	started := make(chan struct{}, tunnels)
	for range tunnels {
		go func() {
			conn, br, resp := e.Connect(dest)
			defer conn.Close()
			if resp.StatusCode != 200 {
				clients <- clientResult{err: fmt.Errorf("status %d", resp.StatusCode)}
				return
			}
			var hdr [16]byte
			binary.BigEndian.PutUint64(hdr[:8], per)
			binary.BigEndian.PutUint64(hdr[8:], per)
			sentCh := make(chan []byte, 1)
			go func() {
				conn.Write(hdr[:])
				sum, err := sendRandom(t, conn, per)
				if err != nil {
					sum = nil
				}
				conn.(*net.UnixConn).CloseWrite()
				sentCh <- sum
			}()
			h := sha256.New()
			n, err := io.CopyN(h, br, 1<<20)
			started <- struct{}{}
			if err == nil {
				var m int64
				m, err = io.Copy(h, br)
				n += m
			}
			clients <- clientResult{sent: <-sentCh, recv: h.Sum(nil), recvN: n, err: err}
		}()
	}
	for range tunnels {
		<-started
	}
	shut := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		shut <- e.srv.Shutdown(ctx)
	}()
	for i := range tunnels {
		c := <-clients
		if c.err != nil || c.sent == nil || c.recvN != per {
			t.Errorf("tunnel %d during Shutdown: received %d of %d bytes (err %v), upload complete %v", i, c.recvN, per, c.err, c.sent != nil)
		}
	}
	if err := <-shut; err != nil {
		t.Errorf("Shutdown: %v", err)
	}
}

// countWriter counts what is written to it.
type countWriter struct{ n *atomic.Int64 }

func (w countWriter) Write(p []byte) (int, error) { w.n.Add(int64(len(p))); return len(p), nil }

// TestHungUpClientEndsTunnel: a client that closes its Unix socket
// completely, through a tunnel whose destination neither writes nor
// closes, cannot end the tunnel by itself (its close reaches the
// destination as a half-close); the hang-up sweep ends it at the server
// and the agent.
func TestHungUpClientEndsTunnel(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	a := e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	release := make(chan struct{})
	defer close(release)
	dest := tunneltest.ServeTCP(t, func(c net.Conn) {
		io.Copy(io.Discard, c) // the client's half-close, then silence
		<-release
	})
	conn, _, resp := e.Connect(dest)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	conn.Close()
	tunneltest.WaitUntil(t, func() bool { return e.frontOpen(t) == 0 && a.Stats.Tunnels.Load() == 0 }, "the hung-up client's tunnel ended")
}
