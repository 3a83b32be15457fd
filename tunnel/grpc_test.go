//lint:file-ignore SA1019 the test client uses x/net/http2's Transport for HTTP/2 with prior knowledge, as kube-apiserver's gRPC client does.

package tunnel

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

func TestPacketRoundTrip(t *testing.T) {
	for _, p := range []packet{
		{Type: pktDialReq, Protocol: "tcp", Address: "10.0.0.1:443", Random: 1<<62 + 5},
		{Type: pktDialRsp, Random: 7, ConnectID: 9},
		{Type: pktDialRsp, Random: 7, Error: "dial failed"},
		{Type: pktData, ConnectID: 3, Data: []byte("hello")},
		{Type: pktCloseReq, ConnectID: 3},
		{Type: pktCloseRsp, ConnectID: 3, Error: "x"},
		{Type: pktDialCls, Random: 11},
		{Type: pktDrain},
		{Type: pktDialReq, Random: -1},
	} {
		got, err := decodePacket(appendPacket(nil, p))
		if err != nil {
			t.Fatalf("%v: %v", p.Type, err)
		}
		if got.Type != p.Type || got.Protocol != p.Protocol || got.Address != p.Address || got.Random != p.Random ||
			got.ConnectID != p.ConnectID || got.Error != p.Error || !bytes.Equal(got.Data, p.Data) {
			t.Fatalf("round trip: %+v -> %+v", p, got)
		}
	}
}

// Bytes produced by the upstream protobuf encoder for
// Packet{type: DIAL_REQ, dialRequest: {protocol: "tcp", address: "127.0.0.1:80", random: 42}}.
func TestPacketDecodesUpstreamBytes(t *testing.T) {
	upstream := []byte{0x12, 0x15, 0x0a, 0x03, 't', 'c', 'p', 0x12, 0x0c, '1', '2', '7', '.', '0', '.', '0', '.', '1', ':', '8', '0', 0x18, 0x2a}
	p, err := decodePacket(upstream)
	if err != nil {
		t.Fatal(err)
	}
	if p.Type != pktDialReq || p.Protocol != "tcp" || p.Address != "127.0.0.1:80" || p.Random != 42 {
		t.Fatalf("decoded %+v", p)
	}
}

func FuzzDecodePacket(f *testing.F) {
	f.Add(appendPacket(nil, packet{Type: pktDialReq, Protocol: "tcp", Address: "a:1", Random: 3}))
	f.Add(appendPacket(nil, packet{Type: pktData, ConnectID: 1, Data: []byte("xyz")}))
	f.Add(appendPacket(nil, packet{Type: pktCloseRsp, ConnectID: 1, Error: "e"}))
	f.Add([]byte{0x08, 0x04, 0x22, 0x00})
	f.Add([]byte{0x08, 0x63})
	f.Add([]byte{0x0b})
	f.Add([]byte{0x12, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := decodePacket(b)
		if err != nil {
			return
		}
		again, err := decodePacket(appendPacket(nil, p))
		if err != nil {
			t.Fatalf("re-encoded packet does not decode: %v", err)
		}
		if again.Type != p.Type || again.Address != p.Address || again.ConnectID != p.ConnectID || !bytes.Equal(again.Data, p.Data) {
			t.Fatalf("re-encode changed %+v into %+v", p, again)
		}
	})
}

func FuzzReadGRPCMessage(f *testing.F) {
	f.Add(appendGRPCMessage(nil, packet{Type: pktDialReq, Address: "a:1"}))
	f.Add([]byte{1, 0, 0, 0, 1, 0})
	f.Add([]byte{0, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		var buf []byte
		for range 100 {
			msg, nbuf, err := readGRPCMessage(r, buf, maxGRPCMessageLen)
			buf = nbuf
			if err != nil {
				return
			}
			if len(msg) > maxGRPCMessageLen {
				t.Fatal("message over the limit accepted")
			}
			decodePacket(msg)
		}
	})
}

// grpcEnv serves the gRPC front door on a Unix socket next to an env.
func (e *env) grpcSocket(t *testing.T) string {
	dir, err := os.MkdirTemp("", "grpc")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "g.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	e.wg.Add(1)
	go func() { defer e.wg.Done(); e.srv.ServeGRPC(ln) }()
	t.Cleanup(func() { ln.Close(); os.RemoveAll(dir) })
	return path
}

// grpcCall is one /ProxyService/Proxy call made by a minimal client.
type grpcCall struct {
	t      *testing.T
	send   *io.PipeWriter
	respCh chan *http.Response
	resp   *http.Response
	buf    []byte
}

// response waits for the response headers. Like grpc-go, the client sends
// its first message without waiting for them.
func (c *grpcCall) response() *http.Response {
	c.t.Helper()
	if c.resp == nil {
		select {
		case c.resp = <-c.respCh:
		case <-time.After(15 * time.Second):
			c.t.Fatal("no response headers")
		}
		if c.resp == nil {
			c.t.Fatal("RoundTrip failed")
		}
	}
	return c.resp
}

func openGRPC(t *testing.T, sock, method string) *grpcCall {
	t.Helper()
	tr := &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}
	pr, pw := io.Pipe()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://konnectivity"+method, pr)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("Te", "trailers")
	c := &grpcCall{t: t, send: pw, respCh: make(chan *http.Response, 1)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Logf("RoundTrip: %v", err)
		}
		c.respCh <- resp
	}()
	t.Cleanup(func() {
		pw.Close()
		cancel()
		<-done
		if c.resp != nil {
			c.resp.Body.Close()
		}
		tr.CloseIdleConnections()
	})
	return c
}

func (c *grpcCall) write(p packet) {
	c.t.Helper()
	if _, err := c.send.Write(appendGRPCMessage(nil, p)); err != nil {
		c.t.Fatal(err)
	}
}

func (c *grpcCall) read() (packet, error) {
	msg, buf, err := readGRPCMessage(c.response().Body, c.buf, maxGRPCMessageLen)
	c.buf = buf
	if err != nil {
		return packet{}, err
	}
	return decodePacket(msg)
}

func (c *grpcCall) status() string {
	resp := c.response()
	io.Copy(io.Discard, resp.Body)
	if s := resp.Header.Get("Grpc-Status"); s != "" {
		return s // trailers-only
	}
	return resp.Trailer.Get("Grpc-Status")
}

func TestGRPCFrontendEcho(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.waitAgents(1)
	sock := e.grpcSocket(t)
	echo := echoServer(t)

	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := openGRPC(t, sock, grpcProxyMethod)
			c.write(packet{Type: pktDialReq, Protocol: "tcp", Address: echo, Random: int64(100 + i)})
			rsp, err := c.read()
			if err != nil || rsp.Type != pktDialRsp || rsp.Random != int64(100+i) || rsp.ConnectID == 0 || rsp.Error != "" {
				t.Errorf("DIAL_RSP: %+v %v", rsp, err)
				return
			}
			payload := bytes.Repeat([]byte{byte(i)}, 100<<10)
			c.write(packet{Type: pktData, ConnectID: rsp.ConnectID, Data: payload})
			var got []byte
			for len(got) < len(payload) {
				p, err := c.read()
				if err != nil || p.Type != pktData {
					t.Errorf("DATA: %+v %v", p.Type, err)
					return
				}
				got = append(got, p.Data...)
			}
			if !bytes.Equal(got, payload) {
				t.Error("echo mismatch")
			}
			c.write(packet{Type: pktCloseReq, ConnectID: rsp.ConnectID})
			p, err := c.read()
			if err != nil || p.Type != pktCloseRsp || p.ConnectID != rsp.ConnectID {
				t.Errorf("CLOSE_RSP: %+v %v", p, err)
			}
			if s := c.status(); s != "0" {
				t.Errorf("grpc-status %q", s)
			}
		}()
	}
	wg.Wait()
}

func TestGRPCFrontendDialFailureAndBadInput(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.waitAgents(1)
	sock := e.grpcSocket(t)

	c := openGRPC(t, sock, grpcProxyMethod)
	c.write(packet{Type: pktDialReq, Protocol: "tcp", Address: "127.0.0.1:1", Random: 5})
	rsp, err := c.read()
	if err != nil || rsp.Type != pktDialRsp || !strings.Contains(rsp.Error, "connection refused") {
		t.Fatalf("failed dial: %+v %v", rsp, err)
	}
	if s := c.status(); s != "0" {
		t.Fatalf("status %q", s)
	}

	c = openGRPC(t, sock, "/AgentService/Connect")
	if s := c.status(); s != "12" {
		t.Fatalf("unknown method: status %q, want 12", s)
	}
	c = openGRPC(t, sock, grpcProxyMethod)
	c.send.Write([]byte{0, 0, 0, 0, 3, 0xff, 0xff, 0xff})
	if s := c.status(); s != "3" {
		t.Fatalf("malformed protobuf: status %q, want 3", s)
	}
	c = openGRPC(t, sock, grpcProxyMethod)
	c.write(packet{Type: pktData, ConnectID: 1, Data: []byte("x")})
	if s := c.status(); s != "3" {
		t.Fatalf("DATA before DIAL_REQ: status %q, want 3", s)
	}
}

// DIAL_CLS cancels the pending dial on the agent too.
func TestGRPCDialCancelReachesAgent(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, func(c *ServerConfig) { c.DialTimeout = 10 * time.Second })
	cancelled := make(chan struct{})
	started := make(chan struct{})
	e.startAgent("a1", "", func(c *AgentConfig) {
		c.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
			close(started)
			<-ctx.Done()
			close(cancelled)
			return nil, ctx.Err()
		}
	})
	e.waitAgents(1)
	sock := e.grpcSocket(t)
	c := openGRPC(t, sock, grpcProxyMethod)
	c.write(packet{Type: pktDialReq, Protocol: "tcp", Address: "192.0.2.1:443", Random: 9})
	<-started
	c.write(packet{Type: pktDialCls, Random: 9})
	select {
	case <-cancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the agent's dial was not cancelled by DIAL_CLS")
	}
	c.send.Close()
	if _, err := c.read(); err != nil && !errors.Is(err, io.EOF) {
		t.Logf("after DIAL_CLS: %v", err)
	}
}

func TestPutDataPrefixMatchesEncoder(t *testing.T) {
	for _, n := range []int{1, 127, 128, 16383, 16384, largeBufSize - dataPrefixRoom} {
		for _, id := range []int64{1, 300, 1 << 40} {
			buf := make([]byte, dataPrefixRoom+n)
			for i := range n {
				buf[dataPrefixRoom+i] = byte(i)
			}
			got := putDataPrefix(buf, id, n)
			want := appendGRPCMessage(nil, packet{Type: pktData, ConnectID: id, Data: buf[dataPrefixRoom : dataPrefixRoom+n]})
			if !bytes.Equal(got, want) {
				t.Fatalf("n=%d id=%d: framing differs from the encoder", n, id)
			}
		}
	}
}
