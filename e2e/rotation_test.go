package e2e

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// newSEC1CA writes a self-signed ECDSA CA whose key is SEC1 ("EC PRIVATE
// KEY"), the format k3s writes for server-ca.key.
func newSEC1CA(t *testing.T, dir, name string) (certPath, keyPath string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: name + "@" + strconv.FormatInt(now.Unix(), 10)},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certPath, keyPath = filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
	writePEM(t, certPath, "CERTIFICATE", der)
	writePEM(t, keyPath, "EC PRIVATE KEY", keyDER)
	return certPath, keyPath
}

// runCert runs `konnectivity cert args...` and returns its one line.
func runCert(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, konnectivityBin, append([]string{"cert"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("konnectivity cert %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// readPEM returns the DER of the first PEM block in path.
func readPEM(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := pem.Decode(data)
	if b == nil {
		t.Fatalf("%s: no PEM", path)
	}
	return b.Bytes
}

func readCert(t *testing.T, path string) *x509.Certificate {
	t.Helper()
	c, err := x509.ParseCertificate(readPEM(t, path))
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return c
}

func certPool(t *testing.T, path string) *x509.CertPool {
	t.Helper()
	pool := x509.NewCertPool()
	pool.AddCert(readCert(t, path))
	return pool
}

// peerCert does a TLS handshake with the agent port as an agent would
// (verifying against roots) and returns the server's certificate.
func peerCert(addr string, roots *x509.CertPool) (*x509.Certificate, error) {
	d := &tls.Dialer{
		NetDialer: &net.Dialer{Timeout: 5 * time.Second},
		Config:    &tls.Config{RootCAs: roots, ServerName: "127.0.0.1"},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	return c.(*tls.Conn).ConnectionState().PeerCertificates[0], nil
}

// waitPeerSerial polls until the agent port serves the certificate with
// serial want (verifying against roots) and returns how long that took.
func waitPeerSerial(t *testing.T, addr string, roots *x509.CertPool, want *big.Int) time.Duration {
	t.Helper()
	start := time.Now()
	var last string
	for {
		c, err := peerCert(addr, roots)
		if err == nil && c.SerialNumber.Cmp(want) == 0 {
			return time.Since(start)
		}
		if err != nil {
			last = err.Error()
		} else {
			last = "serial " + c.SerialNumber.String()
		}
		if time.Since(start) > 15*time.Second {
			t.Fatalf("agent port %s never served serial %s; last: %s", addr, want, last)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestCertRotation: the agent-listener certificate is replaced on disk,
// first from the same CA and then from a new CA, while dials run and
// without restarting anything; and --mint-ca-* mints the pair at start.
func TestCertRotation(t *testing.T) {
	dir := t.TempDir()
	ca1, ca1Key := newSEC1CA(t, dir, "ca1")
	srvDir := filepath.Join(dir, "server")
	sans := "127.0.0.1,localhost"
	if out := runCert(t, "-ca-cert", ca1, "-ca-key", ca1Key, "-dir", srvDir, "-sans", sans); !strings.HasPrefix(out, "minted ") {
		t.Fatalf("first cert: %q, want minted", out)
	}
	// Agent client certificates stay on CA 1 throughout: only the serving
	// side rotates. The server's --cluster-ca-cert is a copy of CA 1, so
	// the agents' --ca-cert file can be rewritten independently.
	clientCA := filepath.Join(dir, "client-ca.crt")
	agentCA := filepath.Join(dir, "agent-trust.crt")
	for _, dst := range []string{clientCA, agentCA} {
		data, err := os.ReadFile(ca1)
		if err != nil {
			t.Fatal(err)
		}
		writeFileAtomic(t, dst, data)
	}
	agentCert, agentKey := filepath.Join(dir, "agent.crt"), filepath.Join(dir, "agent.key")
	runCert(t, "-ca-cert", ca1, "-ca-key", ca1Key, "-client", "-cn", "konnectivity-agent",
		"-out-cert", agentCert, "-out-key", agentKey)
	p := &pki{caCert: agentCA, serverCert: filepath.Join(srvDir, "tls.crt"), serverKey: filepath.Join(srvDir, "tls.key"),
		agentCert: agentCert, agentKey: agentKey}

	s := startServerOpts(t, serverOpts{pki: p, clusterCA: clientCA})
	agentAddr := "127.0.0.1:" + strconv.Itoa(s.agentPort)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	agentArgs := func(port int) []string {
		return haAgentArgs(p, "127.0.0.1", port)
	}
	// Agent 1 reaches the server through a proxy the test can cut.
	proxy := startProxy(t, agentAddr)
	a1 := startAgentArgs(t, "a1", agentArgs(proxy.port())...)
	waitHTTP(t, a1.proc, a1.healthURL("/readyz"), http.StatusOK)
	s.waitAgents(t, 1, startTimeout)

	serial1 := readCert(t, p.serverCert).SerialNumber
	waitPeerSerial(t, agentAddr, certPool(t, ca1), serial1)

	d := s.egressDialer(t)
	checkReachable(t, d, backend, "b1", 3)
	// One long-lived tunnel that must survive both rotations.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	long, err := d.bounded()(ctx, "tcp", echo.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer long.Close()
	_ = long.SetDeadline(time.Now().Add(60 * time.Second))
	longR := bufio.NewReader(long)
	if err := echoOnce(long, longR, "before rotation\n"); err != nil {
		t.Fatal(err)
	}
	loop := startDialLoop(t, backend, "b1", d)
	// Agents started in subtests run until the whole test ends.
	top := t

	t.Run("same-ca-new-cert", func(t *testing.T) {
		// Other SANs: the pair no longer matches the request, so it is
		// minted anew (new key, new serial).
		out := runCert(t, "-ca-cert", ca1, "-ca-key", ca1Key, "-dir", srvDir, "-sans", sans+",rotated.example")
		if !strings.HasPrefix(out, "minted ") {
			t.Fatalf("re-mint with other SANs: %q, want minted", out)
		}
		serial2 := readCert(t, p.serverCert).SerialNumber
		if serial2.Cmp(serial1) == 0 {
			t.Fatalf("re-minted certificate kept serial %s", serial1)
		}
		el := waitPeerSerial(t, agentAddr, certPool(t, ca1), serial2)
		t.Logf("new serial %s served %v after the files were replaced (was %s)", serial2, el.Round(time.Millisecond), serial1)
		// A new agent connection gets it too.
		a2 := startAgentArgs(top, "a2", agentArgs(s.agentPort)...)
		waitHTTP(t, a2.proc, a2.healthURL("/readyz"), http.StatusOK)
		s.waitAgents(t, 2, startTimeout)
		if err := echoOnce(long, longR, "after same-CA rotation\n"); err != nil {
			t.Fatalf("tunnel opened before the rotation: %v", err)
		}
	})

	t.Run("new-ca", func(t *testing.T) {
		ca2, ca2Key := newSEC1CA(t, dir, "ca2")
		// Agents trust CA 2 from now on (their --ca-cert is re-read on
		// every connect), then the server's pair is minted from CA 2.
		data, err := os.ReadFile(ca2)
		if err != nil {
			t.Fatal(err)
		}
		writeFileAtomic(t, agentCA, data)
		out := runCert(t, "-ca-cert", ca2, "-ca-key", ca2Key, "-dir", srvDir, "-sans", sans)
		if !strings.HasPrefix(out, "minted ") {
			t.Fatalf("mint from the new CA: %q, want minted", out)
		}
		serial3 := readCert(t, p.serverCert).SerialNumber
		el := waitPeerSerial(t, agentAddr, certPool(t, ca2), serial3)
		t.Logf("certificate from the new CA (serial %s) served %v after the files were replaced", serial3, el.Round(time.Millisecond))
		if _, err := peerCert(agentAddr, certPool(t, ca1)); err == nil {
			t.Fatalf("a client trusting only the old CA still verifies the agent port")
		}
		// A new agent, trusting only CA 2, connects.
		a3 := startAgentArgs(top, "a3", agentArgs(s.agentPort)...)
		waitHTTP(t, a3.proc, a3.healthURL("/readyz"), http.StatusOK)
		s.waitAgents(t, 3, startTimeout)
		if err := echoOnce(long, longR, "after new-CA rotation\n"); err != nil {
			t.Fatalf("tunnel opened before the rotations: %v", err)
		}
	})
	loop.finish(t, "dial loop during both rotations")
	long.Close()

	t.Run("old-connection-reconnects-with-new-ca", func(t *testing.T) {
		// Agent 1 still holds its connection from before both rotations.
		// Cut it: it must come back by re-reading --ca-cert (now CA 2).
		before := proxy.accepted.Load()
		proxy.cut()
		cut := time.Now()
		waitFor(t, 15*time.Second, "agent a1 reconnected through the proxy", func() bool {
			return proxy.accepted.Load() > before &&
				strings.Count(a1.proc.out.String(), `msg="connected to server"`) >= 2 &&
				s.agentCount() == 3
		})
		t.Logf("a1 reconnected with the new CA %v after its connection was cut", time.Since(cut).Round(time.Millisecond))
		checkReachable(t, d, backend, "b1", 10)
	})
}

// TestMintAtStart: with --mint-ca-cert/--mint-ca-key and no pair on disk,
// the server mints --cluster-cert/--cluster-key itself before listening.
func TestMintAtStart(t *testing.T) {
	dir := t.TempDir()
	ca, caKey := newSEC1CA(t, dir, "ca")
	agentCert, agentKey := filepath.Join(dir, "agent.crt"), filepath.Join(dir, "agent.key")
	runCert(t, "-ca-cert", ca, "-ca-key", caKey, "-client", "-cn", "konnectivity-agent",
		"-out-cert", agentCert, "-out-key", agentKey)
	certFile, keyFile := filepath.Join(dir, "minted", "tls.crt"), filepath.Join(dir, "minted", "tls.key")
	p := &pki{caCert: ca, agentCert: agentCert, agentKey: agentKey}
	s := startServerOpts(t, serverOpts{pki: p, clusterCA: ca, certFile: certFile, keyFile: keyFile,
		extra: []string{"--mint-ca-cert=" + ca, "--mint-ca-key=" + caKey, "--mint-sans=127.0.0.1,localhost"}})
	if line := lineWith(s.proc.out.String(), "minted"); line == "" {
		t.Errorf("server log has no line saying it minted the certificate:\n%s", s.proc.out.String())
	} else {
		t.Logf("%s", line)
	}
	c := readCert(t, certFile)
	if _, err := c.Verify(x509.VerifyOptions{Roots: certPool(t, ca)}); err != nil {
		t.Fatalf("minted %s does not chain to the CA: %v", certFile, err)
	}
	if fi, err := os.Stat(keyFile); err != nil {
		t.Errorf("minted key: %v", err)
	} else if fi.Mode().Perm() != 0o600 {
		t.Errorf("minted key %s: mode %v, want 0600", keyFile, fi.Mode().Perm())
	}
	a := startAgentArgs(t, "a1", haAgentArgs(p, "127.0.0.1", s.agentPort)...)
	waitHTTP(t, a.proc, a.healthURL("/readyz"), http.StatusOK)
	waitHTTP(t, s.proc, s.healthURL("/readyz"), http.StatusOK)
	checkReachable(t, s.egressDialer(t), startHTTPBackend(t, "127.0.0.1", "b1"), "b1", 5)
}
