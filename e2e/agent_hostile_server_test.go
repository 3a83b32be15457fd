package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// hostileServer speaks the server's half of the agent protocol with a
// valid certificate (the Upgrade handshake, then HTTP/2 as the client) and
// opens n CONNECT streams as fast as it can; it counts how the agent
// answered them.
type hostileServer struct {
	ok, refused, reset atomic.Int64 // 200s, other statuses, RST_STREAMs
	ended              atomic.Value // string: why the agent's connection ended, once it did
}

func (h *hostileServer) answered() int64 { return h.ok.Load() + h.refused.Load() + h.reset.Load() }

func startHostileServer(t *testing.T, addr string, certs *pki, dest string, n int) *hostileServer {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(certs.serverCert, certs.serverKey)
	if err != nil {
		t.Fatal(err)
	}
	l, err := tls.Listen("tcp", addr, &tls.Config{Certificates: []tls.Certificate{cert}})
	if err != nil {
		t.Fatalf("hostile server on %s: %v", addr, err)
	}
	h := &hostileServer{}
	done := make(chan struct{})
	var conn net.Conn
	go func() {
		defer close(done)
		c, err := l.Accept()
		if err != nil {
			return
		}
		conn = c
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			t.Errorf("hostile server: agent's handshake: %v", err)
			return
		}
		fmt.Fprintf(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: konnectivity-h2\r\nKonnectivity-Server-Id: hostile\r\nKonnectivity-Server-Count: 2\r\n\r\n")
		if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
			return
		}
		fr := http2.NewFramer(c, br)
		fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
		var wmu sync.Mutex // the flood and the answers to SETTINGS and PING share fr's writes
		if err := fr.WriteSettings(); err != nil {
			return
		}
		go func() { // what the agent answers
			for {
				f, err := fr.ReadFrame()
				if err != nil {
					h.ended.CompareAndSwap(nil, err.Error())
					return
				}
				switch f := f.(type) {
				case *http2.MetaHeadersFrame:
					if f.PseudoValue("status") == "200" {
						h.ok.Add(1)
					} else {
						h.refused.Add(1)
					}
				case *http2.RSTStreamFrame:
					h.reset.Add(1)
				case *http2.GoAwayFrame:
					h.ended.CompareAndSwap(nil, "GOAWAY "+f.ErrCode.String())
				case *http2.SettingsFrame:
					if !f.IsAck() {
						wmu.Lock()
						_ = fr.WriteSettingsAck()
						wmu.Unlock()
					}
				case *http2.PingFrame:
					if !f.IsAck() {
						wmu.Lock()
						_ = fr.WritePing(true, f.Data)
						wmu.Unlock()
					}
				}
			}
		}()
		var hb bytes.Buffer
		enc := hpack.NewEncoder(&hb)
		for i := range n {
			hb.Reset()
			enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
			enc.WriteField(hpack.HeaderField{Name: ":authority", Value: dest})
			wmu.Lock()
			err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: hb.Bytes(), EndHeaders: true})
			wmu.Unlock()
			if err != nil {
				t.Logf("hostile server: stream %d: %v", i, err)
				return
			}
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-done
		if conn != nil {
			conn.Close()
		}
	})
	return h
}

// TestAgentBoundsHostileServerStreams: a server with a valid certificate
// that sends 100,000 CONNECTs gets at most the agent's --max-streams-total
// (from its descriptor limit) and 503 or REFUSED_STREAM for the rest; the agent
// stays below its descriptor limit and keeps serving the real server.
func TestAgentBoundsHostileServerStreams(t *testing.T) {
	const flood = 100000
	s := startServer(t)
	sink := startTCPBackend(t, "127.0.0.1", func(c net.Conn) { _, _ = io.Copy(io.Discard, c) })
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	hostile := startHostileServer(t, fmt.Sprintf("[::1]:%d", s.agentPort), s.pki, sink.addr(), flood)
	a := s.startAgent(t, "a1", "", "--proxy-server-host=127.0.0.1,::1", "--sync-interval=100ms", "--sync-interval-cap=200ms")
	pid := a.proc.cmd.Process.Pid
	limit := nofileLimit(t, pid)
	perConn := min((limit-256)/2, 1<<20) // the agent's whole budget: one server may use it all
	// Every stream answered, or the agent ended the connection; the
	// agent's descriptors and memory at their highest meanwhile.
	fds, rss := 0, 0
	waitFor(t, 2*time.Minute, "the agent answers the flood", func() bool {
		fds, rss = max(fds, faultFDCount(t, pid)), max(rss, faultRSSKiB(t, pid))
		return hostile.answered() >= flood || hostile.ended.Load() != nil
	})
	t.Logf("100,000 CONNECTs from a hostile server: %d accepted, %d refused (503), %d reset, connection ended: %v; agent at most: %d descriptors of %d, RSS %d MiB",
		hostile.ok.Load(), hostile.refused.Load(), hostile.reset.Load(), hostile.ended.Load(), fds, limit, rss>>10)
	if got := hostile.ok.Load(); got > int64(perConn) {
		t.Errorf("hostile server got %d tunnels, want at most %d (--max-streams-total from RLIMIT_NOFILE %d)", got, perConn, limit)
	}
	if fds >= limit {
		t.Errorf("agent at its descriptor limit: %d of %d", fds, limit)
	}
	if hostile.ended.Load() != nil {
		// The agent ended the hostile connection: its tunnels go as their
		// handlers return, and then the real server's dials have room.
		waitFor(t, 30*time.Second, "the agent has let the hostile connection's tunnels go", func() bool {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			c, err := s.egressDialer(t).bounded()(ctx, "tcp", echo.addr())
			if err != nil {
				return false
			}
			c.Close()
			return true
		})
	}
	for i := range 5 {
		c := openEcho(t, s, echo)
		if err := echoOnce(c, bufio.NewReader(c), fmt.Sprintf("real %d\n", i)); err != nil {
			t.Errorf("real server's tunnel %d during the attack: %v", i, err)
		}
	}
}

// nofileLimit is the soft RLIMIT_NOFILE of pid.
func nofileLimit(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		if f := bytes.Fields(line); len(f) >= 5 && string(f[0]) == "Max" && string(f[1]) == "open" {
			n, err := strconv.Atoi(string(f[3]))
			if err != nil {
				t.Fatalf("limits line %q", line)
			}
			return n
		}
	}
	t.Fatal("no open files limit")
	return 0
}
