package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client"
	clientmetrics "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/pkg/client/metrics"
)

// The gRPC frontend (--mode=grpc) driven by the upstream client library
// itself, one single-use tunnel per dial, as kube-apiserver does.

// grpcDialer dials through the server's unix socket with konnectivity-client.
func grpcDialer(sock string) dialFunc {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		tunnelCtx, cancel := context.WithCancel(context.Background())
		tunnel, err := client.CreateSingleUseGrpcTunnelWithContext(ctx, tunnelCtx, "passthrough:///"+sock,
			grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", sock)
			}),
			grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			cancel()
			return nil, fmt.Errorf("create gRPC tunnel: %w", err)
		}
		c, err := tunnel.DialContext(ctx, network, addr)
		if err != nil {
			cancel()
			return nil, err
		}
		return &tunnelConn{Conn: c, cancel: cancel}, nil
	}
}

// tunnelConn ends the tunnel's context once the connection is closed.
type tunnelConn struct {
	net.Conn
	cancel context.CancelFunc
}

func (c *tunnelConn) Close() error {
	err := c.Conn.Close()
	c.cancel()
	return err
}

func TestGRPCClient(t *testing.T) {
	s := startServer(t, "--mode=grpc")
	s.startAgent(t, "a1", "")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := grpcDialer(s.sock)

	t.Run("sequential-200", func(t *testing.T) {
		start := time.Now()
		checkReachable(t, d, backend, "b1", 200)
		t.Logf("200 sequential requests, one gRPC tunnel each, in %v", time.Since(start).Round(time.Millisecond))
	})

	t.Run("concurrent-100", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		client := d.httpClient(false, nil)
		var wg sync.WaitGroup
		var failed atomic.Int64
		start := time.Now()
		for i := range 100 {
			wg.Go(func() {
				if err := getHello(ctx, client, backend, "b1", i); err != nil && failed.Add(1) <= 5 {
					t.Errorf("request %d: %v", i, err)
				}
			})
		}
		wg.Wait()
		if n := failed.Load(); n > 0 {
			t.Fatalf("%d of 100 concurrent requests failed", n)
		}
		t.Logf("100 concurrent requests in %v", time.Since(start).Round(time.Millisecond))
	})

	t.Run("closed-port", func(t *testing.T) {
		before := metricValue(t, s.healthURL("/metrics"), srvPrefix+"dial_failure_count", "reason", "error_response")
		addr := closedPort(t)
		el, err := dialErr(t, d, addr, 15*time.Second)
		if err == nil {
			t.Fatalf("dial to closed port %s succeeded", addr)
		}
		// The agent's own error text reaches the client.
		if !strings.Contains(err.Error(), "connection refused") {
			t.Errorf("dial to closed port %s: %q after %v, want the agent's \"connection refused\"", addr, err, el)
		}
		if el > 5*time.Second {
			t.Errorf("dial to closed port took %v: not answered at once", el)
		}
		if got := metricValue(t, s.healthURL("/metrics"), srvPrefix+"dial_failure_count", "reason", "error_response"); got != before+1 {
			t.Errorf("dial_failure_count{reason=\"error_response\"} = %v, want %v", got, before+1)
		}
		t.Logf("closed port: %v after %v", err, el.Round(time.Millisecond))
	})

	t.Run("stalled-stream", func(t *testing.T) {
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		var written atomic.Int64
		hose := startTCPBackend(t, "127.0.0.1", firehoseHandler(&written))
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		stalled, err := d.bounded()(ctx, "tcp", hose.addr())
		if err != nil {
			t.Fatalf("dial firehose: %v", err)
		}
		defer stalled.Close()
		if _, err := stalled.Write([]byte{'!'}); err != nil {
			t.Fatal(err)
		}
		n := waitPlateau(t, &written, "firehose into a gRPC tunnel whose client never reads")
		t.Logf("stalled gRPC tunnel holds %d bytes in flight", n)
		// konnectivity-client conns have no deadlines ("not implemented"),
		// so a watchdog bounds the reads instead. The library also closes a
		// tunnel whose reader stalls 10 s, so this all happens sooner.
		echoNoDeadline(t, d.bounded(), echo.addr(), 200)
		const want = 1 << 20
		got := make([]byte, want)
		watchdog := time.AfterFunc(8*time.Second, func() { stalled.Close() })
		defer watchdog.Stop()
		if _, err := io.ReadFull(stalled, got); err != nil {
			t.Fatalf("reading the formerly stalled tunnel: %v", err)
		}
		chunk := pattern(32 << 10)
		for off := 0; off < want; off += len(chunk) {
			if !bytes.Equal(got[off:off+len(chunk)], chunk) {
				t.Fatalf("formerly stalled tunnel: data corrupt at offset %d", off)
			}
		}
	})
}

// TestGRPCCancelledDial: a dial whose context ends while the server waits
// for an agent returns at once with a context failure, and the server
// forgets it (pending_backend_dials back to 0, frontend_close counted).
func TestGRPCCancelledDial(t *testing.T) {
	s := startServer(t, "--mode=grpc", "--agent-wait=10s")
	metricsURL := s.healthURL("/metrics")
	before := metricValue(t, metricsURL, srvPrefix+"dial_failure_count", "reason", "frontend_close")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type result struct {
		err error
		at  time.Time
	}
	res := make(chan result, 1)
	go func() {
		c, err := grpcDialer(s.sock)(ctx, "tcp", "127.0.0.1:1")
		if c != nil {
			c.Close()
		}
		res <- result{err, time.Now()}
	}()
	waitMetric(t, metricsURL, 1, srvPrefix+"pending_backend_dials")
	if v := metricValue(t, metricsURL, srvPrefix+"grpc_connections", "service_method", "Proxy"); v != 1 {
		t.Errorf("grpc_connections{service_method=\"Proxy\"} = %v while one dial waits, want 1", v)
	}
	cancelled := time.Now()
	cancel()
	var r result
	select {
	case r = <-res:
	case <-time.After(5 * time.Second):
		t.Fatal("dial still pending 5 s after its context was cancelled (--agent-wait=10s)")
	}
	isDialFailure, reason := client.GetDialFailureReason(r.err)
	if r.err == nil || !isDialFailure || reason != clientmetrics.DialFailureContext {
		t.Errorf("cancelled dial: err %v (dial failure %v, reason %q), want reason %q", r.err, isDialFailure, reason, clientmetrics.DialFailureContext)
	}
	t.Logf("cancelled dial returned %v after the cancel: %v", r.at.Sub(cancelled).Round(time.Millisecond), r.err)
	waitMetric(t, metricsURL, 0, srvPrefix+"pending_backend_dials")
	waitMetric(t, metricsURL, before+1, srvPrefix+"dial_failure_count", "reason", "frontend_close")
	waitMetric(t, metricsURL, 0, srvPrefix+"grpc_connections", "service_method", "Proxy")
}

// TestGRPCNodeImageCommandLine starts the server with the node image's
// command line (openrc/konnectivity-server.initd) in --mode=grpc: token
// auth against a kubeconfig, default bind addresses, destHost,default.
func TestGRPCNodeImageCommandLine(t *testing.T) {
	p := newPKI(t, t.TempDir())
	api := startFakeAPIServer(t, p)
	dir, err := os.MkdirTemp("", "kse2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	kc := filepath.Join(dir, "k3s.yaml")
	api.writeKubeconfig(t, p, kc)
	s := &server{owner: t, dir: dir, pki: p,
		sock:      filepath.Join(dir, "konnectivity-server.socket"),
		agentPort: freePort(t), healthPort: freePort(t), adminPort: freePort(t)}
	s.args = []string{"server", "--mode=grpc",
		"--uds-name=" + s.sock, "--delete-existing-uds-file=true", "--server-port=0",
		"--agent-port=" + strconv.Itoa(s.agentPort),
		"--cluster-cert=" + p.serverCert, "--cluster-key=" + p.serverKey,
		"--proxy-strategies=destHost,default",
		"--server-count=1",
		"--health-port=" + strconv.Itoa(s.healthPort), "--admin-port=" + strconv.Itoa(s.adminPort),
	}
	s.args = append(s.args, tokenAuthFlags(kc)...)
	// A stale socket from a previous run must be replaced.
	if l, err := net.Listen("unix", s.sock); err == nil {
		l.(*net.UnixListener).SetUnlinkOnClose(false)
		l.Close()
	}
	s.launch(t)
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte(goodToken), 0o600); err != nil {
		t.Fatal(err)
	}
	a := startAgentArgs(t, "node-1",
		"--proxy-server-host=127.0.0.1", "--proxy-server-port="+strconv.Itoa(s.agentPort),
		"--ca-cert="+p.caCert, "--service-account-token-path="+token,
		"--agent-identifiers=host=node-1&ipv4=127.0.0.1")
	waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
	waitHTTP(t, s.proc, s.healthURL("/readyz"), http.StatusOK)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	checkReachable(t, grpcDialer(s.sock), backend, "b1", 20)
	checkReachable(t, s.egressDialerProto(t, "GRPC"), backend, "b1", 20)
	if fi, err := os.Stat(s.sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket %s: %v %v, want mode 0600", s.sock, fi.Mode(), err)
	}
	_, err = dialErr(t, grpcDialer(s.sock), closedPort(t), 10*time.Second)
	if err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("closed port through the node-image server: %v, want the agent's error", err)
	}
}

// echoNoDeadline is echoMany for conns without deadlines: a timer closes
// the conn if the round trips take longer than 8 s.
func echoNoDeadline(t *testing.T, d dialFunc, addr string, n int) {
	t.Helper()
	echoWithin(t, d, addr, n, 8*time.Second, false)
}
