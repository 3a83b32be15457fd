package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	apiserverapi "k8s.io/apiserver/pkg/apis/apiserver"
)

// TestEgressTCPmTLS: kube-apiserver's other HTTPConnect transport, TCP with
// mutual TLS (--server-port with --server-cert/--server-key/--server-ca-cert).
func TestEgressTCPmTLS(t *testing.T) {
	s := startServerWith(t, frontendTCP)
	s.startAgent(t, "a1", "")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialer(t)

	t.Run("requests", func(t *testing.T) {
		checkReachable(t, d, backend, "b1", 50)
	})

	t.Run("closed-port-502", func(t *testing.T) {
		el, err := dialErr(t, d, closedPort(t), 10*time.Second)
		if err == nil || !strings.Contains(err.Error(), "code 502") {
			t.Fatalf("dial to closed port over TCP frontend: %v after %v, want \"code 502\"", err, el)
		}
	})

	// A client without a certificate, or with one from another CA, must
	// not get a tunnel.
	caPEM, err := os.ReadFile(s.pki.caCert)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(caPEM)
	other := newPKI(t, t.TempDir())
	foreign, err := tls.LoadX509KeyPair(other.agentCert, other.agentKey)
	if err != nil {
		t.Fatal(err)
	}
	for name, certs := range map[string][]tls.Certificate{
		"no-client-cert":      nil,
		"foreign-client-cert": {foreign},
	} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			dialer := &tls.Dialer{Config: &tls.Config{RootCAs: roots, ServerName: "127.0.0.1", Certificates: certs}}
			c, err := dialer.DialContext(ctx, "tcp", s.frontendAddr())
			if err != nil {
				t.Logf("refused at handshake: %v", err)
				return
			}
			defer c.Close()
			// TLS 1.3: the server checks the client certificate after the
			// client's handshake finished, so the refusal shows on read.
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			_, _ = io.WriteString(c, connectHead(backend))
			buf := make([]byte, 256)
			n, err := c.Read(buf)
			if err == nil {
				t.Fatalf("frontend answered a client with %s: %q", name, buf[:n])
			}
			t.Logf("refused: %v", err)
		})
	}
}

// grpcModeSupported reports whether the binary accepts --mode=grpc: it
// starts a throwaway server and looks for a quick "not supported" exit.
func grpcModeSupported(t *testing.T) bool {
	t.Helper()
	dir, err := os.MkdirTemp("", "kse2e")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	p := newPKI(t, dir)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, konnectivityBin, "server", "--mode=grpc",
		"--uds-name="+filepath.Join(dir, "probe.sock"), "--server-port=0",
		"--agent-bind-address=127.0.0.1", "--agent-port="+strconv.Itoa(freePort(t)),
		"--cluster-cert="+p.serverCert, "--cluster-key="+p.serverKey, "--cluster-ca-cert="+p.caCert,
		"--health-bind-address=127.0.0.1", "--health-port="+strconv.Itoa(freePort(t)),
		"--admin-port="+strconv.Itoa(freePort(t)))
	out, _ := cmd.CombinedOutput()
	if ctx.Err() != nil {
		return true // still running after 2 s: it started
	}
	t.Logf("server --mode=grpc exited at once: %s", strings.TrimSpace(string(out)))
	return !strings.Contains(string(out), "not supported")
}

// TestEgressGRPC: kube-apiserver's GRPC egress (konnectivity-client, one
// single-use tunnel per dial). Skipped while the binary does not offer
// --mode=grpc.
func TestEgressGRPC(t *testing.T) {
	if !grpcModeSupported(t) {
		t.Skip("binary does not support --mode=grpc yet")
	}
	s := startServer(t, "--mode=grpc")
	s.startAgent(t, "a1", "")
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	d := s.egressDialerProto(t, apiserverapi.ProtocolGRPC)

	t.Run("sequential", func(t *testing.T) {
		checkReachable(t, d, backend, "b1", 100)
	})
	t.Run("concurrent", func(t *testing.T) {
		var wg sync.WaitGroup
		for range 10 {
			wg.Go(func() {
				if err := reach(d, backend, "b1", 10); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
	})
	t.Run("closed-port", func(t *testing.T) {
		el, err := dialErr(t, d, closedPort(t), 15*time.Second)
		if err == nil {
			t.Fatal("dial to a closed port succeeded")
		}
		t.Logf("closed port over grpc: %v after %v", err, el.Round(time.Millisecond))
	})
}

// TestUpstreamInvocation runs the binary the way existing manifests and
// init scripts run upstream: through the konnectivity-server and
// konnectivity-agent names, with space-separated flag values and klog
// flags that are accepted for compatibility.
func TestUpstreamInvocation(t *testing.T) {
	binDir := t.TempDir()
	for _, name := range []string{"konnectivity-server", "konnectivity-agent"} {
		if err := os.Symlink(konnectivityBin, filepath.Join(binDir, name)); err != nil {
			t.Fatal(err)
		}
	}
	dir, err := os.MkdirTemp("", "kse2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s := &server{
		owner: t, dir: dir, pki: newPKI(t, dir), sock: filepath.Join(dir, "k.sock"),
		agentPort: freePort(t), healthPort: freePort(t), adminPort: freePort(t),
	}
	s.proc = startProcBin(t, filepath.Join(binDir, "konnectivity-server"), "server",
		"--logtostderr=true", "--v", "4",
		"--mode", "http-connect",
		"--uds-name", s.sock, "--delete-existing-uds-file",
		"--server-port", "0",
		"--agent-bind-address", "127.0.0.1", "--agent-port", strconv.Itoa(s.agentPort),
		"--cluster-cert", s.pki.serverCert, "--cluster-key", s.pki.serverKey,
		"--cluster-ca-cert", s.pki.caCert,
		"--health-bind-address", "127.0.0.1", "--health-port", strconv.Itoa(s.healthPort),
		"--admin-bind-address", "127.0.0.1", "--admin-port", strconv.Itoa(s.adminPort),
		"--keepalive-time", "1h", "--proxy-strategies", "destHost,default")
	waitHTTP(t, s.proc, s.healthURL("/healthz"), 200)
	a := &agent{id: "a1", healthPort: freePort(t), adminPort: freePort(t)}
	a.proc = startProcBin(t, filepath.Join(binDir, "konnectivity-agent"), "agent-a1",
		"--logtostderr=true", "--v", "4",
		"--proxy-server-host", "127.0.0.1", "--proxy-server-port", strconv.Itoa(s.agentPort),
		"--ca-cert", s.pki.caCert, "--agent-cert", s.pki.agentCert, "--agent-key", s.pki.agentKey,
		"--agent-identifiers", "host=localhost&ipv4=127.0.0.1",
		"--health-server-host", "127.0.0.1", "--health-server-port", strconv.Itoa(a.healthPort),
		"--admin-bind-address", "127.0.0.1", "--admin-server-port", strconv.Itoa(a.adminPort),
		"--sync-interval", "1s", "--probe-interval", "1s", "--keepalive-time", "1h")
	waitHTTP(t, a.proc, a.healthURL("/readyz"), 200)
	waitHTTP(t, s.proc, s.healthURL("/readyz"), 200)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	checkReachable(t, s.egressDialer(t), backend, "b1", 10)
}
