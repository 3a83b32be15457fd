package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	proxypb "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"
)

// grpcNullEnv makes the bench binary act as a null gRPC proxy in its own
// process: it serves kube-apiserver's ProxyService on the Unix socket named
// by the variable's value, but dials each destination itself, with no
// tunnel behind it. The same konnectivity-client through it measures the
// floor of the gRPC protocol (client library, grpc-go, HTTP/2 framing).
const grpcNullEnv = "KONNECTIVITY_BENCH_GRPC_NULL"

const (
	nullDialTimeout = 10 * time.Second
	nullBufSize     = 128 << 10 // destination -> client read size
)

// runGRPCNullHelper serves ProxyService on the socket named by grpcNullEnv,
// prints the socket path and exits when its stdin closes.
func runGRPCNullHelper() int {
	sock := os.Getenv(grpcNullEnv)
	_ = os.Remove(sock)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		fmt.Fprintf(os.Stderr, "gRPC null proxy: %v\n", err)
		return 1
	}
	srv := grpc.NewServer()
	proxypb.RegisterProxyServiceServer(srv, &nullProxy{})
	go func() { _ = srv.Serve(ln) }()
	fmt.Println(sock)
	_, _ = io.Copy(io.Discard, os.Stdin)
	srv.Stop() // closes the listener and every stream; handlers then end
	_ = os.Remove(sock)
	return 0
}

// startGRPCNullHelper starts the null proxy on sock, in its own process so
// that its CPU is not the client's.
func startGRPCNullHelper(ctx context.Context, sock string) (*helperProc, error) {
	h, err := startHelper(ctx, "gRPC null proxy", grpcNullEnv+"="+sock)
	if err != nil {
		return nil, err
	}
	if h.addr != sock {
		h.stop()
		return nil, fmt.Errorf("gRPC null proxy did not come up on %s (printed %q)", sock, h.addr)
	}
	return h, nil
}

type nullProxy struct {
	proxypb.UnimplementedProxyServiceServer
	nextID atomic.Int64
}

// nullStream is one Proxy call: one dial.
type nullStream struct {
	s      proxypb.ProxyService_ProxyServer
	sendMu sync.Mutex // Send is not safe from two goroutines

	mu      sync.Mutex
	dest    net.Conn // set once dialled
	ending  bool     // the client closed or went away: the handler answers
	rspSent bool     // CLOSE_RSP sent
}

func (n *nullStream) send(p *proxypb.Packet) error {
	n.sendMu.Lock()
	defer n.sendMu.Unlock()
	return n.s.Send(p)
}

// closeRsp sends the one CLOSE_RSP of the connection.
func (n *nullStream) closeRsp(id int64, errText string) {
	n.mu.Lock()
	sent := n.rspSent
	n.rspSent = true
	n.mu.Unlock()
	if !sent {
		_ = n.send(&proxypb.Packet{Type: proxypb.PacketType_CLOSE_RSP, Payload: &proxypb.Packet_CloseResponse{
			CloseResponse: &proxypb.CloseResponse{ConnectID: id, Error: errText}}})
	}
}

// end marks the connection as ended by the client and closes the
// destination, if dialled.
func (n *nullStream) end() {
	n.mu.Lock()
	n.ending = true
	d := n.dest
	n.mu.Unlock()
	if d != nil {
		d.Close()
	}
}

// Proxy serves one stream: DIAL_REQ, DIAL_RSP, then DATA both ways until
// either side closes. The handler goroutine receives; a second goroutine
// dials and then copies destination -> client. Every goroutine has ended
// when the handler returns.
func (p *nullProxy) Proxy(s proxypb.ProxyService_ProxyServer) error {
	first, err := s.Recv()
	if err != nil {
		return err
	}
	req := first.GetDialRequest()
	if first.Type != proxypb.PacketType_DIAL_REQ || req == nil {
		return status.Errorf(codes.InvalidArgument, "first packet is %s, want DIAL_REQ", first.Type)
	}
	n := &nullStream{s: s}
	id := p.nextID.Add(1)
	dctx, cancel := context.WithTimeout(s.Context(), nullDialTimeout)
	defer cancel()
	down := make(chan struct{})
	go func() {
		defer close(down)
		n.dialAndCopy(dctx, req, id)
	}()
	// Stop the dial or the copy, and wait for it, however the handler ends.
	defer func() {
		cancel()
		n.end()
		<-down
	}()

	var dest net.Conn
	for {
		pkt, err := s.Recv()
		if err != nil {
			// The client went away (konnectivity-client never half-closes).
			return nil
		}
		switch pkt.Type {
		case proxypb.PacketType_DATA:
			if dest == nil {
				// DATA follows DIAL_RSP, which is sent after dest is set.
				n.mu.Lock()
				dest = n.dest
				n.mu.Unlock()
				if dest == nil {
					return status.Error(codes.FailedPrecondition, "DATA before DIAL_RSP")
				}
			}
			if _, err := dest.Write(pkt.GetData().GetData()); err != nil {
				// The copier sees the closed destination and sends CLOSE_RSP.
				dest.Close()
			}
		case proxypb.PacketType_CLOSE_REQ:
			n.end()
			<-down
			n.closeRsp(id, "")
			return nil
		case proxypb.PacketType_DIAL_CLS:
			return nil // the deferred end cancels the dial
		}
	}
}

// dialAndCopy dials the destination, answers DIAL_RSP and copies the
// destination's bytes to the client as DATA until it closes.
func (n *nullStream) dialAndCopy(ctx context.Context, req *proxypb.DialRequest, id int64) {
	dialRsp := func(id int64, errText string) error {
		return n.send(&proxypb.Packet{Type: proxypb.PacketType_DIAL_RSP, Payload: &proxypb.Packet_DialResponse{
			DialResponse: &proxypb.DialResponse{Random: req.Random, ConnectID: id, Error: errText}}})
	}
	if req.Protocol != "" && req.Protocol != "tcp" {
		_ = dialRsp(0, fmt.Sprintf("protocol %q not supported", req.Protocol))
		return
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", req.Address)
	if err != nil {
		_ = dialRsp(0, err.Error())
		return
	}
	n.mu.Lock()
	if n.ending {
		n.mu.Unlock()
		c.Close()
		return
	}
	n.dest = c
	n.mu.Unlock()
	if err := dialRsp(id, ""); err != nil {
		return
	}
	buf := make([]byte, nullBufSize)
	var rerr error
	for {
		k, err := c.Read(buf)
		if k > 0 {
			// Send marshals the packet before it returns, so buf is reused.
			if err := n.send(&proxypb.Packet{Type: proxypb.PacketType_DATA, Payload: &proxypb.Packet_Data{
				Data: &proxypb.Data{ConnectID: id, Data: buf[:k]}}}); err != nil {
				return
			}
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				rerr = err
			}
			break
		}
	}
	n.mu.Lock()
	ending := n.ending
	n.mu.Unlock()
	if ending {
		return // the handler answers the client's CLOSE_REQ
	}
	errText := ""
	if rerr != nil {
		errText = rerr.Error()
	}
	n.closeRsp(id, errText)
}
