package server

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
)

// A client of the other protocol than a front door's, from a raw socket:
// it is answered in its own protocol with the reason, and what the server
// reads from it is bounded in bytes, frames and time. The header timeout
// is a minute where the bound under test is another, so a close well
// before it shows that bound at work.

// readGoAway reads frames until a GOAWAY and returns it with the gRPC
// status message of any HEADERS before it.
func readGoAway(t *testing.T, c net.Conn) (*http2.GoAwayFrame, []string) {
	t.Helper()
	fr := http2.NewFramer(io.Discard, c)
	fr.ReadMetaHeaders = nil
	var heads []string
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("no GOAWAY from the HTTP CONNECT door: %v", err)
		}
		switch f := f.(type) {
		case *http2.HeadersFrame:
			heads = append(heads, string(f.HeaderBlockFragment()))
		case *http2.GoAwayFrame:
			return f, heads
		}
	}
}

func TestModeMismatchGRPCClientOnConnectDoor(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	const headerTimeout = time.Second
	e := newEnv(t, func(c *Config) { c.HeaderTimeout = headerTimeout })
	preface := func(t *testing.T) (net.Conn, *http2.Framer) {
		c, err := net.Dial("unix", e.UDS)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(20 * time.Second))
		io.WriteString(c, http2.ClientPreface)
		fr := http2.NewFramer(c, nil)
		fr.WriteSettings()
		return c, fr
	}
	checkGoAway := func(t *testing.T, g *http2.GoAwayFrame, last uint32) {
		t.Helper()
		if g.ErrCode != http2.ErrCodeHTTP11Required || g.LastStreamID != last || !strings.Contains(string(g.DebugData()), "--mode=http-connect") {
			t.Errorf("GOAWAY %v last stream %d debug %q; want HTTP_1_1_REQUIRED, %d, the mode", g.ErrCode, g.LastStreamID, g.DebugData(), last)
		}
	}

	t.Run("dial", func(t *testing.T) { // what konnectivity-client sends: a call, then its DIAL_REQ
		c, fr := preface(t)
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte{0x83, 0x86}, EndHeaders: true}) // POST, http
		fr.WriteData(1, false, grpcwire.AppendMessage(nil, grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: "10.0.0.1:443", Random: 42}))
		rd := http2.NewFramer(io.Discard, c)
		var rsp grpcwire.Packet
		for {
			f, err := rd.ReadFrame()
			if err != nil {
				t.Fatalf("no DIAL_RSP: %v", err)
			}
			if d, ok := f.(*http2.DataFrame); ok && d.StreamID == 1 {
				if rsp, err = grpcwire.Decode(d.Data()[grpcwire.HeaderLen:]); err != nil {
					t.Fatal(err)
				}
				break
			}
		}
		if rsp.Type != grpcwire.DialRsp || rsp.Random != 42 || !strings.Contains(rsp.Error, "konnectivity server runs --mode=http-connect") {
			t.Errorf("answer %+v; want a DIAL_RSP to random 42 naming the mode", rsp)
		}
		g, _ := readGoAway(t, c)
		checkGoAway(t, g, 1)
	})

	t.Run("silent", func(t *testing.T) { // no call: the GOAWAY at the header timeout
		c, _ := preface(t)
		start := time.Now()
		g, _ := readGoAway(t, c)
		checkGoAway(t, g, 0)
		if took := time.Since(start); took < headerTimeout/2 || took > headerTimeout+5*time.Second {
			t.Errorf("GOAWAY to a silent client after %v; want it at the header timeout (%v)", took, headerTimeout)
		}
	})

	t.Run("frames", func(t *testing.T) { // a flood of frames with no call: read up to a count, then the GOAWAY
		c, fr := preface(t)
		for range 100 {
			fr.WritePing(false, [8]byte{})
		}
		start := time.Now()
		g, _ := readGoAway(t, c)
		checkGoAway(t, g, 0)
		if took := time.Since(start); took >= headerTimeout {
			t.Errorf("GOAWAY after %v: the frame count did not end the reading", took)
		}
	})
}

func TestModeMismatchBounded(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) { c.HeaderTimeout = time.Minute })
	grpcSock := e.grpcSocket(t)
	dial := func(t *testing.T, sock string) net.Conn {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		c.SetDeadline(time.Now().Add(20 * time.Second))
		return c
	}

	t.Run("grpc-door-connect", func(t *testing.T) { // kube-apiserver's HTTP CONNECT dialer
		c := dial(t, grpcSock)
		io.WriteString(c, "CONNECT 10.0.0.1:443 HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: kube-apiserver\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(resp.Status, "konnectivity server runs --mode=grpc") {
			t.Errorf("answer %q; want 400 naming the mode", resp.Status)
		}
	})

	t.Run("grpc-door-endless-head", func(t *testing.T) { // a head past 16 KiB: answered and closed, not read on
		c := dial(t, grpcSock)
		io.WriteString(c, "CONNECT 10.0.0.1:443 HTTP/1.1\r\n")
		go func() { // until the server stops reading
			line := []byte("X-Pad: " + strings.Repeat("a", 1000) + "\r\n")
			for range 200 {
				if _, err := c.Write(line); err != nil {
					return
				}
			}
		}()
		got, err := io.ReadAll(io.LimitReader(c, 4<<10))
		if !bytes.Contains(got, []byte("HTTP/1.1 400 Bad Request: konnectivity server runs --mode=grpc")) {
			t.Errorf("answer %q (%v); want 400 naming the mode", got, err)
		}
	})

	t.Run("connect-door-preface-only", func(t *testing.T) { // a preface cut short: closed, no answer
		c := dial(t, e.UDS)
		io.WriteString(c, "PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")
		if n, err := io.Copy(io.Discard, c); err != nil && !strings.Contains(err.Error(), "reset") {
			t.Errorf("after %d bytes: %v; want the connection closed", n, err)
		}
	})

	t.Run("connect-door-bytes", func(t *testing.T) { // past the head limit in one frame stream: closed
		c := dial(t, e.UDS)
		io.WriteString(c, http2.ClientPreface)
		fr := http2.NewFramer(c, nil)
		go func() {
			for range 64 { // 64 × 1 KiB of DATA on a stream never opened
				if fr.WriteData(3, false, make([]byte, 1<<10)) != nil {
					return
				}
			}
		}()
		g, _ := readGoAway(t, c)
		if g.ErrCode != http2.ErrCodeHTTP11Required {
			t.Errorf("GOAWAY %v, want HTTP_1_1_REQUIRED", g.ErrCode)
		}
		if _, err := io.Copy(io.Discard, c); err != nil && !strings.Contains(err.Error(), "reset") {
			t.Errorf("after the GOAWAY: %v; want the connection closed before the header timeout", err)
		}
	})
}
