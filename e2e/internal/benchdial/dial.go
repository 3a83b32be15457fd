package benchdial

import (
	"context"
	"fmt"
	"io"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"
)

// ConnectOK is the server's answer to a CONNECT that reached its
// destination.
const ConnectOK = "HTTP/1.1 200 Connection Established\r\n\r\n"

// Connect opens a tunnel to target through the HTTP CONNECT front door on
// the Unix socket sock; within bounds the dial and the answer.
func Connect(ctx context.Context, sock, target string, within time.Duration) (net.Conn, error) {
	d := net.Dialer{Timeout: within}
	c, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", sock, err)
	}
	if err := c.SetDeadline(time.Now().Add(within)); err != nil {
		c.Close()
		return nil, err
	}
	if _, err := io.WriteString(c, "CONNECT "+target+" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); err != nil {
		c.Close()
		return nil, fmt.Errorf("write CONNECT %s: %w", target, err)
	}
	// The benchmarks' destinations speak only after the client has, so
	// nothing can follow the answer yet: reading its exact length is safe.
	buf := make([]byte, len(ConnectOK))
	n, err := io.ReadFull(c, buf)
	if err != nil || string(buf) != ConnectOK {
		// Collect the rest of an error answer for the message.
		_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		rest, _ := io.ReadAll(io.LimitReader(c, 512))
		c.Close()
		return nil, fmt.Errorf("CONNECT %s: answer %q (read error %v)", target, append(buf[:n], rest...), err)
	}
	if err := c.SetDeadline(time.Time{}); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// GRPC opens a tunnel to target through the gRPC front door on the Unix
// socket sock as kube-apiserver does for proxyProtocol GRPC: a new
// single-use tunnel (its own gRPC connection) from upstream's
// konnectivity-client; within bounds the dial.
func GRPC(ctx context.Context, sock, target string, within time.Duration) (net.Conn, error) {
	dctx, cancel := context.WithTimeout(ctx, within)
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
	return c, nil
}
