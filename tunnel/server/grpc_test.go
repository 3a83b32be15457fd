//lint:file-ignore SA1019 the test client uses x/net/http2's Transport for HTTP/2 with prior knowledge, as kube-apiserver's gRPC client does.

package server

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/agent"
	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// grpcSocket serves the gRPC front door on a Unix socket next to an env.
func (e *env) grpcSocket(t testing.TB) string { return e.ServeUnix(t, e.srv.ServeGRPC) }

func TestGRPCFrontendEcho(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	sock := e.grpcSocket(t)
	echo := tunneltest.EchoServer(t)

	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := tunneltest.OpenGRPC(t, sock, grpcwire.ProxyMethod)
			c.Write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: echo, Random: int64(100 + i)})
			rsp, err := c.Read()
			if err != nil || rsp.Type != grpcwire.DialRsp || rsp.Random != int64(100+i) || rsp.ConnectID == 0 || rsp.Error != "" {
				t.Errorf("DIAL_RSP: %+v %v", rsp, err)
				return
			}
			payload := bytes.Repeat([]byte{byte(i)}, 100<<10)
			c.Write(grpcwire.Packet{Type: grpcwire.Data, ConnectID: rsp.ConnectID, Data: payload})
			var got []byte
			for len(got) < len(payload) {
				p, err := c.Read()
				if err != nil || p.Type != grpcwire.Data {
					t.Errorf("DATA: %+v %v", p.Type, err)
					return
				}
				got = append(got, p.Data...)
			}
			if !bytes.Equal(got, payload) {
				t.Error("echo mismatch")
			}
			c.Write(grpcwire.Packet{Type: grpcwire.CloseReq, ConnectID: rsp.ConnectID})
			p, err := c.Read()
			if err != nil || p.Type != grpcwire.CloseRsp || p.ConnectID != rsp.ConnectID {
				t.Errorf("CLOSE_RSP: %+v %v", p, err)
			}
			if s := c.Status(); s != "0" {
				t.Errorf("grpc-status %q", s)
			}
		}()
	}
	wg.Wait()
}

func TestGRPCFrontendDialFailureAndBadInput(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	e.startAgent("a1", "", nil)
	e.WaitAgents(1)
	sock := e.grpcSocket(t)

	c := tunneltest.OpenGRPC(t, sock, grpcwire.ProxyMethod)
	c.Write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: "127.0.0.1:1", Random: 5})
	rsp, err := c.Read()
	if err != nil || rsp.Type != grpcwire.DialRsp || !strings.Contains(rsp.Error, "connection refused") {
		t.Fatalf("failed dial: %+v %v", rsp, err)
	}
	if s := c.Status(); s != "0" {
		t.Fatalf("status %q", s)
	}

	c = tunneltest.OpenGRPC(t, sock, "/AgentService/Connect")
	if s := c.Status(); s != "12" {
		t.Fatalf("unknown method: status %q, want 12", s)
	}
	c = tunneltest.OpenGRPC(t, sock, grpcwire.ProxyMethod)
	c.Send.Write([]byte{0, 0, 0, 0, 3, 0xff, 0xff, 0xff})
	if s := c.Status(); s != "3" {
		t.Fatalf("malformed protobuf: status %q, want 3", s)
	}
	c = tunneltest.OpenGRPC(t, sock, grpcwire.ProxyMethod)
	c.Write(grpcwire.Packet{Type: grpcwire.Data, ConnectID: 1, Data: []byte("x")})
	if s := c.Status(); s != "3" {
		t.Fatalf("DATA before DIAL_REQ: status %q, want 3", s)
	}
}

// DIAL_CLS cancels the pending dial on the agent too.
func TestGRPCDialCancelReachesAgent(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *Config) { c.DialTimeout = 10 * time.Second })
	cancelled := make(chan struct{})
	started := make(chan struct{})
	e.startAgent("a1", "", func(c *agent.Config) {
		c.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
			close(started)
			<-ctx.Done()
			close(cancelled)
			return nil, ctx.Err()
		}
	})
	e.WaitAgents(1)
	sock := e.grpcSocket(t)
	c := tunneltest.OpenGRPC(t, sock, grpcwire.ProxyMethod)
	c.Write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: "192.0.2.1:443", Random: 9})
	<-started
	c.Write(grpcwire.Packet{Type: grpcwire.DialCls, Random: 9})
	select {
	case <-cancelled:
	case <-time.After(5 * time.Second):
		t.Fatal("the agent's dial was not cancelled by DIAL_CLS")
	}
	c.Send.Close()
	if _, err := c.Read(); err != nil && !errors.Is(err, io.EOF) {
		t.Logf("after DIAL_CLS: %v", err)
	}
}

// TestIdleGRPCCallsParkOnlyTheirWaiter checks what an idle call on the
// gRPC front door keeps on the server: its waiter (waitGRPC), and no
// goroutine carrying either direction, nor the handler whose stack the
// dial grew. Half the calls echoed bytes both ways, half sent nothing
// after their DIAL_REQ (the upload's watcher has not seen a byte). Once
// the calls end, their waiters are gone too.
func TestIdleGRPCCallsParkOnlyTheirWaiter(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e, echo := newEchoEnv(t)
	defer e.Stop()
	tr := tunneltest.GRPCTransport(e.grpcSocket(t))
	const n = 20
	calls, ids := make([]*tunneltest.GRPCCall, n), make([]int64, n)
	for i := range calls {
		c := tunneltest.OpenGRPCOn(t, tr, grpcwire.ProxyMethod)
		calls[i] = c
		c.Write(grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: echo, Random: int64(i)})
		rsp, err := c.Read()
		if err != nil || rsp.Type != grpcwire.DialRsp || rsp.Error != "" {
			t.Fatalf("DIAL_RSP: %+v %v", rsp, err)
		}
		ids[i] = rsp.ConnectID
		if i%2 == 1 {
			continue
		}
		c.Write(grpcwire.Packet{Type: grpcwire.Data, ConnectID: ids[i], Data: []byte("ping")})
		if p, err := c.Read(); err != nil || string(p.Data) != "ping" {
			t.Fatalf("echo: %+v %v", p, err)
		}
	}
	// parked counts the server's goroutines by what they run.
	parked := func() (waiters, others int) {
		buf := make([]byte, 1<<22)
		buf = buf[:runtime.Stack(buf, true)]
		for _, g := range strings.Split(string(buf), "\n\n") {
			switch {
			case strings.Contains(g, "server.(*Server).waitGRPC"):
				waiters++
			case strings.Contains(g, "server.(*carrier).run"), strings.Contains(g, "server.(*grpcConn).ServeHTTP"):
				others++
			}
		}
		return waiters, others
	}
	settled := func(want int) (waiters, others int) {
		deadline := time.Now().Add(10 * time.Second)
		for {
			waiters, others = parked()
			if (waiters == want && others == 0) || time.Now().After(deadline) {
				return waiters, others
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if w, o := settled(n); w != n || o != 0 {
		t.Fatalf("%d idle calls: %d waiters and %d handlers or carriers on the server, want %d and 0", n, w, o, n)
	}
	for i, c := range calls {
		c.Write(grpcwire.Packet{Type: grpcwire.CloseReq, ConnectID: ids[i]})
		if st := c.Status(); st != "0" {
			t.Fatalf("call %d ended with status %q, want 0", i, st)
		}
	}
	if w, o := settled(0); w != 0 || o != 0 {
		t.Fatalf("%d calls ended: %d waiters and %d handlers or carriers left", n, w, o)
	}
}
