package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	apiserverapi "k8s.io/apiserver/pkg/apis/apiserver"
)

// TestModeMismatch: kube-apiserver's egress dialer of the other protocol
// than the server's --mode is refused with the reason in its own error,
// and the server logs one line naming both modes: the gRPC door answers
// HTTP CONNECT with an HTTP/1.1 status whose reason phrase says it, the
// HTTP CONNECT door answers gRPC with a GOAWAY whose debug text says it.
func TestModeMismatch(t *testing.T) {
	for _, c := range []struct {
		serverMode string
		client     apiserverapi.ProtocolType
		want       string // in the dial's error
	}{
		{"grpc", apiserverapi.ProtocolHTTPConnect, "konnectivity server runs --mode=grpc; this client speaks HTTP CONNECT (proxyProtocol: HTTPConnect)"},
		{"http-connect", apiserverapi.ProtocolGRPC, "konnectivity server runs --mode=http-connect; this client speaks gRPC (proxyProtocol: GRPC)"},
	} {
		t.Run(c.serverMode, func(t *testing.T) {
			s := startServer(t, "--mode="+c.serverMode)
			s.startAgent(t, "a1", "")
			backend := startHTTPBackend(t, "127.0.0.1", "b1")
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			start := time.Now()
			conn, err := s.egressDialerProto(t, c.client)(ctx, "tcp", backend)
			if err == nil {
				conn.Close()
				t.Fatalf("a %s client dialled through a --mode=%s server", c.client, c.serverMode)
			}
			t.Logf("%s client after %v: %v", c.client, time.Since(start).Round(time.Millisecond), err)
			if !strings.Contains(err.Error(), c.want) {
				t.Errorf("the dial's error does not say why: %v; want it to contain %q", err, c.want)
			}
			waitFor(t, 5*time.Second, "the server logs the mismatch", func() bool {
				return strings.Contains(s.proc.out.String(), "server_mode="+c.serverMode)
			})
			if n := strings.Count(s.proc.out.String(), "kube-apiserver's egress selector and --mode disagree"); n != 1 {
				t.Errorf("%d server lines about the mismatch, want 1:\n%s", n, grepLines(s.proc.out.String(), "--mode"))
			}
		})
	}
}
