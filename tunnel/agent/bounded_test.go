package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"math"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// Bounded reads where a peer speaks first: a gRPC length prefix is a
// promise, not a payment, and an agent reads a bounded answer head.

// rawGRPC is an HTTP/2 client written frame by frame on one connection to
// the gRPC front door, so it can announce what it never sends.
type rawGRPC struct {
	t    *testing.T
	conn net.Conn
	wmu  sync.Mutex
	fr   *http2.Framer
	enc  *hpack.Encoder
	hbuf bytes.Buffer
	next uint32

	mu       sync.Mutex
	statuses map[uint32]string // grpc-status per stream, once ended
	reset    map[uint32]bool   // streams reset by the server
	data     map[uint32][]byte // DATA received per stream
	changed  chan struct{}
	done     chan struct{}
}

func dialRawGRPC(t *testing.T, sock string) *rawGRPC {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	r := &rawGRPC{t: t, conn: c, next: 1, statuses: map[uint32]string{}, reset: map[uint32]bool{}, data: map[uint32][]byte{}, changed: make(chan struct{}), done: make(chan struct{})}
	r.fr = http2.NewFramer(c, bufio.NewReader(c))
	r.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	r.enc = hpack.NewEncoder(&r.hbuf)
	io.WriteString(c, http2.ClientPreface)
	r.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20})
	go r.readLoop()
	t.Cleanup(func() { c.Close(); <-r.done })
	return r
}

func (r *rawGRPC) readLoop() {
	defer close(r.done)
	for {
		f, err := r.fr.ReadFrame()
		if err != nil {
			return
		}
		r.mu.Lock()
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				r.write(func() error { return r.fr.WriteSettingsAck() })
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				r.write(func() error { return r.fr.WritePing(true, f.Data) })
			}
		case *http2.MetaHeadersFrame:
			if s := f.PseudoValue("status"); s == "" || f.StreamEnded() {
				for _, hf := range f.Fields {
					if hf.Name == "grpc-status" {
						r.statuses[f.StreamID] = hf.Value
					}
				}
			}
		case *http2.DataFrame:
			r.data[f.StreamID] = append(r.data[f.StreamID], f.Data()...)
			if n := uint32(len(f.Data())); n > 0 {
				r.write(func() error {
					r.fr.WriteWindowUpdate(0, n)
					return r.fr.WriteWindowUpdate(f.StreamID, n)
				})
			}
		case *http2.RSTStreamFrame:
			r.reset[f.StreamID] = true
		}
		close(r.changed)
		r.changed = make(chan struct{})
		r.mu.Unlock()
	}
}

func (r *rawGRPC) write(f func() error) error {
	r.wmu.Lock()
	defer r.wmu.Unlock()
	return f()
}

// open starts a /ProxyService/Proxy call and sends body as its first bytes.
func (r *rawGRPC) open(body []byte) uint32 {
	r.wmu.Lock()
	defer r.wmu.Unlock()
	id := r.next
	r.next += 2
	r.hbuf.Reset()
	for _, hf := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", grpcwire.ProxyMethod}, {":authority", "konnectivity"}, {"content-type", "application/grpc"}, {"te", "trailers"}} {
		r.enc.WriteField(hpack.HeaderField{Name: hf[0], Value: hf[1]})
	}
	if err := r.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: r.hbuf.Bytes(), EndHeaders: true}); err != nil {
		r.t.Fatal(err)
	}
	if err := r.fr.WriteData(id, false, body); err != nil {
		r.t.Fatal(err)
	}
	return id
}

func (r *rawGRPC) send(id uint32, body []byte) {
	r.write(func() error { return r.fr.WriteData(id, false, body) })
}

// waitFor waits until cond holds (under r.mu) or the bound passes.
func (r *rawGRPC) waitFor(bound time.Duration, cond func() bool) bool {
	deadline := time.After(bound)
	for {
		r.mu.Lock()
		ok := cond()
		ch := r.changed
		r.mu.Unlock()
		if ok {
			return true
		}
		select {
		case <-ch:
		case <-r.done:
			return false
		case <-deadline:
			return false
		}
	}
}

func announce(n uint32, prefix []byte) []byte {
	b := []byte{0, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[1:], n)
	return append(b, prefix...)
}

// 1000 calls on one front-door connection each announce a 16 MiB first
// message and send nothing more: every one is refused at the DIAL_REQ cap
// and the server's heap does not grow by what was announced.
func TestGRPCAnnouncedFirstMessageBounded(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	sock := e.grpcSocket(t)
	r := dialRawGRPC(t, sock)
	before := tunneltest.HeapInuse()
	const calls = 1000
	for range calls {
		r.open(announce(grpcwire.MaxMessageLen, nil))
	}
	ended := func() int { // under r.mu
		n := len(r.statuses)
		for id := range r.reset {
			if _, ok := r.statuses[id]; !ok {
				n++ // refused unanswered, as over the stream limit
			}
		}
		return n
	}
	if !r.waitFor(20*time.Second, func() bool { return ended() >= calls }) {
		r.mu.Lock()
		defer r.mu.Unlock()
		t.Fatalf("%d of %d calls ended", ended(), calls)
	}
	growth := int64(tunneltest.HeapInuse()) - int64(before)
	r.mu.Lock()
	counts := map[string]int{}
	for _, s := range r.statuses {
		counts[s]++
	}
	unanswered := ended() - len(r.statuses)
	r.mu.Unlock()
	t.Logf("%d calls announcing %d MiB each (%d MiB in all): grpc-status counts %v, %d reset unanswered; heap growth %d KiB",
		calls, grpcwire.MaxMessageLen>>20, calls*grpcwire.MaxMessageLen>>20, counts, unanswered, growth>>10)
	if counts["3"] != len(r.statuses) || counts["3"] == 0 {
		t.Errorf("calls answered %v, want INVALID_ARGUMENT (3) for each", counts)
	}
	if growth > 32<<20 {
		t.Errorf("heap grew %d MiB for messages that never came", growth>>20)
	}
}

// Established tunnels whose client announces a 16 MiB DATA message and
// sends one byte of it: the server holds what arrived, not what was
// announced; a well-behaved call on the same connection is served.
func TestGRPCAnnouncedDataMessageBounded(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e, echo := newEchoEnv(t)
	sock := e.grpcSocket(t)
	r := dialRawGRPC(t, sock)
	const tunnels = 100
	ids := make([]uint32, tunnels)
	for i := range ids {
		ids[i] = r.open(grpcwire.AppendMessage(nil, grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: echo, Random: int64(i + 1)}))
	}
	// Each DIAL_RSP: a 5-byte prefix and a short packet.
	if !r.waitFor(20*time.Second, func() bool {
		for _, id := range ids {
			if len(r.data[id]) < grpcwire.HeaderLen+4 {
				return false
			}
		}
		return true
	}) {
		t.Fatal("not every tunnel was answered")
	}
	before := tunneltest.HeapInuse()
	for _, id := range ids {
		r.mu.Lock()
		msg, _, err := grpcwire.ReadMessage(bytes.NewReader(r.data[id]), nil, grpcwire.MaxMessageLen)
		r.mu.Unlock()
		p, derr := grpcwire.Decode(msg)
		if err != nil || derr != nil || p.Type != grpcwire.DialRsp || p.Error != "" {
			t.Fatalf("stream %d: DIAL_RSP %+v %v %v", id, p, err, derr)
		}
		r.send(id, announce(grpcwire.MaxMessageLen, []byte{0x08}))
	}
	// The server reads each announcement as it arrives; look a few times.
	var peak int64
	for range 5 {
		time.Sleep(100 * time.Millisecond)
		peak = max(peak, int64(tunneltest.HeapInuse())-int64(before))
	}
	var served atomic.Bool
	c := tunneltest.OpenGRPC(t, sock, grpcwire.ProxyMethod)
	c.Write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: echo, Random: 1})
	if rsp, err := c.Read(); err == nil && rsp.Type == grpcwire.DialRsp && rsp.Error == "" {
		served.Store(true)
	}
	t.Logf("%d tunnels each announcing a %d MiB message (%d MiB in all) and sending 1 byte: peak heap growth %d KiB; a well-behaved call served: %v",
		tunnels, grpcwire.MaxMessageLen>>20, tunnels*grpcwire.MaxMessageLen>>20, peak>>10, served.Load())
	if peak > 32<<20 {
		t.Errorf("heap grew %d MiB for announced bytes that never came", peak>>20)
	}
	if !served.Load() {
		t.Error("a well-behaved call was not served")
	}
}

// A "server" that answers the agent's handshake with a 101 whose head
// never ends: the agent gives up at the head bound, long before the 15 s
// handshake deadline, holding at most the bound. Plain TCP
// (PlainForTest): a TLS handshake's allocations, on both ends in this
// process, would be most of what the test measures.
func TestAgentBoundsHandshakeAnswerHead(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	for _, tc := range []struct{ name, start, repeat string }{
		{"endless header lines", "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + wire.UpgradeToken + "\r\n", "X-Pad: " + strings.Repeat("a", 100) + "\r\n"},
		{"one endless line", "HTTP/1.1 101 Switching Protocols\r\nX-Pad: ", strings.Repeat("a", 1000)},
		{"endless status line", "HTTP/1.1 101 ", strings.Repeat("b", 1000)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var sent atomic.Int64
			startBytes, repeatBytes := []byte(tc.start), []byte(tc.repeat)
			addr := tunneltest.ServeTCP(t, func(c net.Conn) {
				br := bufio.NewReader(c)
				for { // the agent's request head
					line, err := br.ReadString('\n')
					if err != nil {
						return
					}
					if line == "\r\n" {
						break
					}
				}
				c.SetWriteDeadline(time.Now().Add(10 * time.Second))
				n, err := c.Write(startBytes)
				sent.Add(int64(n))
				for err == nil {
					n, err = c.Write(repeatBytes)
					sent.Add(int64(n))
				}
			})
			a, err := New(Config{ServerAddrs: []string{addr}, ID: "a1", PlainForTest: true})
			if err != nil {
				t.Fatal(err)
			}
			// TotalAlloc counts every goroutine of the test process (the
			// test's server, tests winding down): other work only adds to
			// it, so the least of three dials is the agent's own.
			var (
				l     *connToServer
				took  time.Duration
				alloc uint64 = math.MaxUint64
			)
			for range 3 {
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				start := time.Now()
				l, err = a.dial(context.Background(), target{addr: addr, serverName: "127.0.0.1"})
				took = time.Since(start)
				runtime.ReadMemStats(&after)
				alloc = min(alloc, after.TotalAlloc-before.TotalAlloc)
				if err == nil {
					break
				}
			}
			if err == nil {
				l.conn.Close()
				t.Fatal("an endless answer head was accepted")
			}
			t.Logf("%s: %v after %s; the server wrote %d bytes before the agent hung up; the agent allocated %d KiB",
				tc.name, err, took.Round(time.Millisecond), sent.Load(), alloc>>10)
			if !strings.Contains(err.Error(), "larger than") {
				t.Fatalf("dial: %v, want the head bound", err)
			}
			if alloc > 4*wire.MaxHandshakeHead+64<<10 {
				t.Errorf("the agent allocated %d KiB reading a head bounded at %d KiB", alloc>>10, wire.MaxHandshakeHead>>10)
			}
		})
	}
}
