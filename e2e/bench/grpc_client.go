package main

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"
)

// grpcDialer dials through the gRPC front door exactly as kube-apiserver
// does for proxyProtocol GRPC: a new single-use tunnel (its own gRPC
// connection over the socket) per dial, from upstream's konnectivity-client.
func grpcDialer(sock string) dialer {
	return func(ctx context.Context, target string) (net.Conn, error) {
		dctx, cancel := context.WithTimeout(ctx, dialTimeout)
		defer cancel()
		tun, err := client.CreateSingleUseGrpcTunnelWithContext(dctx, context.Background(), "passthrough:///"+sock,
			grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", sock)
			}),
			grpc.WithTransportCredentials(insecure.NewCredentials()),
		)
		if err != nil {
			return nil, fmt.Errorf("gRPC tunnel to %s: %w", sock, err)
		}
		c, err := tun.DialContext(dctx, "tcp", target)
		if err != nil {
			return nil, fmt.Errorf("gRPC dial %s: %w", target, err)
		}
		return &timedConn{Conn: c}, nil
	}
}

// timedConn gives konnectivity-client's connections (whose deadline
// methods are not implemented) deadlines by closing them when one passes,
// so every bench operation stays bounded.
type timedConn struct {
	net.Conn
	mu    sync.Mutex
	timer *time.Timer
}

func (c *timedConn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.timer != nil {
		c.timer.Stop()
		c.timer = nil
	}
	if !t.IsZero() {
		c.timer = time.AfterFunc(time.Until(t), func() { c.Conn.Close() })
	}
	return nil
}

func (c *timedConn) SetReadDeadline(t time.Time) error  { return c.SetDeadline(t) }
func (c *timedConn) SetWriteDeadline(t time.Time) error { return c.SetDeadline(t) }

func (c *timedConn) Close() error {
	c.SetDeadline(time.Time{})
	return c.Conn.Close()
}
