package e2e

import (
	"crypto"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// reissue replaces the certificate at certPath, keeping its key at keyPath,
// its names and its usage, with one signed by p's CA that is valid from
// notBefore to notAfter.
func reissue(t *testing.T, p *pki, certPath, keyPath string, notBefore, notAfter time.Time) {
	t.Helper()
	old := readCert(t, certPath)
	ca := readCert(t, p.caCert)
	caKey := readPKCS8(t, p.caKey)
	key := readPKCS8(t, keyPath)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      old.Subject,
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     old.KeyUsage,
		ExtKeyUsage:  old.ExtKeyUsage,
		DNSNames:     old.DNSNames,
		IPAddresses:  old.IPAddresses,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.(crypto.Signer).Public(), caKey)
	if err != nil {
		t.Fatalf("reissue %s: %v", certPath, err)
	}
	writeFileAtomic(t, certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}

func readPKCS8(t *testing.T, path string) any {
	t.Helper()
	k, err := x509.ParsePKCS8PrivateKey(readPEM(t, path))
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return k
}

// refusedForCertificate sends p SIGHUP and checks that the restart is
// refused for the certificate at file (reason "certificate", counted, the
// file named in one log line) and that the same image keeps serving. A
// process that re-executes instead is reported with what its tunnels
// became, and the test fails.
func refusedForCertificate(t *testing.T, p *proc, metricsURL, family, file string, conns []net.Conn) {
	t.Helper()
	before := startTime(metricsURL)
	p.signal(t, syscall.SIGHUP)
	reexecuted := false
	waitFor(t, 20*time.Second, "the restart refused or a new image", func() bool {
		if st := startTime(metricsURL); st != 0 && st != before {
			reexecuted = true
		}
		return reexecuted || p.exited() || strings.Contains(p.out.String(), "restart refused")
	})
	if p.exited() {
		t.Fatalf("%s exited after SIGHUP: %v", p.name, p.waitErr)
	}
	if reexecuted {
		checkTunnelsKept(t, conns, "restart into a certificate out of its validity")
		t.Fatalf("%s re-executed into a certificate out of its validity (%s)", p.name, file)
	}
	out := p.out.String()
	line := lineWith(out, "restart refused")
	t.Logf("%s", line)
	if !strings.Contains(line, "reason=certificate") || !strings.Contains(line, file) {
		t.Errorf("the refusal does not say reason=certificate and name %s: %s", file, line)
	}
	if n := strings.Count(out, "restart refused"); n != 1 {
		t.Errorf("%d refusal lines, want 1", n)
	}
	fams, _, err := scrapeRaw(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	if got := fams.value(family, "reason", "certificate"); got != 1 {
		t.Errorf("%s{reason=certificate} = %v, want 1", family, got)
	}
	if got := fams.value(family, "reason", "config"); got != 0 {
		t.Errorf("%s{reason=config} = %v, want 0", family, got)
	}
	if now := startTime(metricsURL); now != before {
		t.Errorf("process start time %v, was %v: the process re-executed", now, before)
	}
}

// TestFaultRestartCertificateOutOfValidity: a SIGHUP while the certificate the
// next image would present has expired (the server's agent-listener pair)
// or is not valid yet (an agent's client pair) is refused: the running
// image holds its peers on the connections they made while the pair was
// good, the next image would have none, as every peer refuses the pair.
// The running image keeps every tunnel and says why; once the pair is
// renewed the restart goes through and hands every tunnel over. A server
// that mints its own pair (--mint-ca-cert) would mint a fresh one and is
// not refused (TestCheckCertificateValidity in package main).
func TestFaultRestartCertificateOutOfValidity(t *testing.T) {
	const tunnels = 10
	t.Run("server-expired", func(t *testing.T) {
		s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS, "--restart-grace=5s")
		s.startAgent(t, "a1", "", "--sync-interval=100ms", "--sync-interval-cap=200ms")
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		var conns []net.Conn
		for range tunnels {
			conns = append(conns, openEcho(t, s, echo))
		}
		good, err := os.ReadFile(s.pki.serverCert)
		if err != nil {
			t.Fatal(err)
		}
		reissue(t, s.pki, s.pki.serverCert, s.pki.serverKey, time.Now().Add(-48*time.Hour), time.Now().Add(-time.Hour))
		metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
		refusedForCertificate(t, s.proc, metricsURL, "konnectivity_network_proxy_server_restarts_refused_total", s.pki.serverCert, conns)
		checkTunnelsKept(t, conns, "refused restart")
		c := openEcho(t, s, echo) // the running image still serves new dials
		checkTunnelsKept(t, []net.Conn{c}, "a dial after the refusal")
		writeFileAtomic(t, s.pki.serverCert, good)
		took := restartOnce(t, s)
		t.Logf("restart once the certificate was renewed took %v", took.Round(time.Millisecond))
		checkTunnelsKept(t, conns, "restart once the certificate was renewed")
	})
	t.Run("agent-not-yet-valid", func(t *testing.T) {
		s := startServerBin(t, copyExecutable(t, t.TempDir()), frontendUDS)
		a := s.launchAgentFrom(t, copyExecutable(t, t.TempDir()), nil, s.pki, "a1", "",
			"--sync-interval=100ms", "--sync-interval-cap=200ms")
		waitHTTP(t, a.proc, a.healthURL("/readyz"), 200)
		waitHTTP(t, s.proc, s.healthURL("/readyz"), 200)
		echo := startTCPBackend(t, "127.0.0.1", echoHandler)
		var conns []net.Conn
		for range tunnels {
			conns = append(conns, openEcho(t, s, echo))
		}
		reissue(t, s.pki, s.pki.agentCert, s.pki.agentKey, time.Now().Add(time.Hour), time.Now().Add(48*time.Hour))
		metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", a.adminPort)
		refusedForCertificate(t, a.proc, metricsURL, "konnectivity_network_proxy_agent_restarts_refused_total", s.pki.agentCert, conns)
		checkTunnelsKept(t, conns, "refused agent restart")
	})
}
