//lint:file-ignore SA1019 the test client uses x/net/http2's Transport for HTTP/2 with prior knowledge, as kube-apiserver's gRPC client does.

package tunneltest

import (
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// GRPCCall is one /ProxyService/Proxy call made by a minimal client.
type GRPCCall struct {
	t      *testing.T
	Send   *io.PipeWriter
	respCh chan *http.Response
	resp   *http.Response
	buf    []byte
}

// response waits for the response headers. Like grpc-go, the client sends
// its first message without waiting for them.
func (c *GRPCCall) response() *http.Response {
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

func OpenGRPC(t *testing.T, sock, method string) *GRPCCall {
	t.Helper()
	return OpenGRPCOn(t, GRPCTransport(sock), method)
}

// GRPCTransport makes HTTP/2 connections with prior knowledge to sock; its
// calls share one connection while it takes them.
func GRPCTransport(sock string) *http2.Transport {
	return &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		},
	}
}

// OpenGRPCOn opens a call on tr.
func OpenGRPCOn(t *testing.T, tr *http2.Transport, method string) *GRPCCall {
	t.Helper()
	pr, pw := io.Pipe()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://konnectivity"+method, pr)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("Te", "trailers")
	c := &GRPCCall{t: t, Send: pw, respCh: make(chan *http.Response, 1)}
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

func (c *GRPCCall) Write(p grpcwire.Packet) {
	c.t.Helper()
	if _, err := c.Send.Write(grpcwire.AppendMessage(nil, p)); err != nil {
		c.t.Fatal(err)
	}
}

func (c *GRPCCall) Read() (grpcwire.Packet, error) {
	msg, buf, err := grpcwire.ReadMessage(c.response().Body, c.buf, grpcwire.MaxMessageLen)
	c.buf = buf
	if err != nil {
		return grpcwire.Packet{}, err
	}
	return grpcwire.Decode(msg)
}

func (c *GRPCCall) Status() string {
	resp := c.response()
	io.Copy(io.Discard, resp.Body)
	if s := resp.Header.Get("Grpc-Status"); s != "" {
		return s // trailers-only
	}
	return resp.Trailer.Get("Grpc-Status")
}
