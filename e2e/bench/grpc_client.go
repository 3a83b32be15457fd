package main

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchdial"
)

// grpcDialer dials through the gRPC front door as kube-apiserver does for
// proxyProtocol GRPC (benchdial.GRPC); its connections get deadlines
// (timedConn).
func grpcDialer(sock string) dialer {
	return func(ctx context.Context, target string) (net.Conn, error) {
		c, err := benchdial.GRPC(ctx, sock, target, dialTimeout)
		if err != nil {
			return nil, err
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
