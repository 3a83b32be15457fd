package certs

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/testnet"
)

// pairEnv holds a served pair that tests replace on disk.
type pairEnv struct {
	*ensureEnv
	clock *fakeClock
	logs  *syncBuffer
	r     *Reloader
}

func newPairEnv(t *testing.T) *pairEnv {
	t.Helper()
	e := newEnsureEnv(t)
	e.ensure(t, e.opts())
	logs := &syncBuffer{}
	r, err := NewReloader(e.certFile, e.keyFile, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	clock := newFakeClock()
	clock.install(&r.t)
	return &pairEnv{ensureEnv: e, clock: clock, logs: logs, r: r}
}

// rotate re-mints the pair under a fresh CA and returns the new leaf.
func (p *pairEnv) rotate(t *testing.T) *x509.Certificate {
	t.Helper()
	p.ca = newCA(t, "next-ca")
	o := p.opts()
	o.CA = p.ca
	expectMinted(t, p.ensure(t, o), "not signed by the current CA")
	return parseCertFile(t, p.certFile)
}

func TestReloaderPicksUpNewPair(t *testing.T) {
	p := newPairEnv(t)
	first := served(t, p.r)
	mustContain(t, p.logs.String(), "TLS certificate loaded")
	mustContain(t, p.logs.String(), "notAfter="+formatTime(first.NotAfter))

	next := p.rotate(t)
	// Within the check interval the files are not even looked at.
	if got := served(t, p.r); !got.Equal(first) {
		t.Fatal("reloaded before the check interval elapsed")
	}
	p.clock.Advance(checkInterval)
	if got := served(t, p.r); !got.Equal(next) {
		t.Fatalf("serving serial %x, want new %x", got.SerialNumber, next.SerialNumber)
	}
	if !p.r.NotAfter().Equal(next.NotAfter) {
		t.Fatalf("NotAfter %v, want %v", p.r.NotAfter(), next.NotAfter)
	}
	mustContain(t, p.logs.String(), "TLS certificate reloaded")
}

func TestReloaderKeepsOldPairOnBadFiles(t *testing.T) {
	p := newPairEnv(t)
	first := served(t, p.r)
	oldKey := readFile(t, p.keyFile)
	oldCert := readFile(t, p.certFile)
	check := func(step string) {
		t.Helper()
		p.clock.Advance(checkInterval)
		if got := served(t, p.r); !got.Equal(first) {
			t.Fatalf("%s: switched to a bad pair", step)
		}
	}

	// Garbage certificate.
	writeFile(t, p.certFile, []byte("garbage"), 0o644)
	check("garbage cert")
	mustContain(t, p.logs.String(), "refusing changed TLS certificate files")

	// The transient state of a rotation: new key, old certificate.
	writeFile(t, p.certFile, oldCert, 0o644)
	_, otherKey, err := p.ca.Issue(Request{CommonName: "x", Client: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteFileAtomic(p.keyFile, otherKey, 0o600); err != nil {
		t.Fatal(err)
	}
	check("mismatched key")
	mustContain(t, p.logs.String(), "private key does not match public key")

	// Files deleted.
	if err := os.Remove(p.certFile); err != nil {
		t.Fatal(err)
	}
	check("deleted cert")
	mustContain(t, p.logs.String(), "cannot check TLS certificate files")

	// Restoring the pair recovers; then a real rotation is taken.
	writeFile(t, p.keyFile, oldKey, 0o600)
	writeFile(t, p.certFile, oldCert, 0o644)
	check("restored")
	next := p.rotate(t)
	p.clock.Advance(checkInterval)
	if got := served(t, p.r); !got.Equal(next) {
		t.Fatal("did not pick up a good pair after bad ones")
	}
}

func TestNewReloaderErrors(t *testing.T) {
	e := newEnsureEnv(t)
	e.ensure(t, e.opts())
	_, otherKey, err := e.ca.Issue(Request{CommonName: "x", Client: true})
	if err != nil {
		t.Fatal(err)
	}
	mismatched := filepath.Join(e.dir, "other.key")
	writeFile(t, mismatched, otherKey, 0o600)
	cases := map[string][2]string{
		"missing cert": {filepath.Join(e.dir, "nope"), e.keyFile},
		"missing key":  {e.certFile, filepath.Join(e.dir, "nope")},
		"mismatch":     {e.certFile, mismatched},
		"swapped":      {e.keyFile, e.certFile},
	}
	for name, c := range cases {
		if _, err := NewReloader(c[0], c[1], nil); err == nil {
			t.Errorf("%s: NewReloader succeeded", name)
		}
	}
}

// echoServer accepts TLS connections and echoes lines until the test ends.
func echoServer(t *testing.T, cfg *tls.Config) string {
	t.Helper()
	ln, err := tls.Listen("tcp", "127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := testnet.Serve(ln, func(c net.Conn) { _, _ = io.Copy(c, c) })
	t.Cleanup(s.Close)
	return s.Addr()
}

// roundTrip sends a line and expects it back.
func roundTrip(c *tls.Conn, msg string) error {
	if err := c.SetDeadline(time.Now().Add(30 * time.Second)); err != nil {
		return err
	}
	if _, err := io.WriteString(c, msg+"\n"); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != msg+"\n" {
		return io.ErrUnexpectedEOF
	}
	return nil
}

func dial(t *testing.T, addr string, cfg *tls.Config) *tls.Conn {
	t.Helper()
	c, err := tls.Dial("tcp", addr, cfg)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestTLSServerRotation: new handshakes get the rotated certificate while
// a connection made before the rotation keeps working.
func TestTLSServerRotation(t *testing.T) {
	p := newPairEnv(t)
	first := served(t, p.r)
	firstCA := p.ca
	cfg, err := ServerConfig(p.r, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr := echoServer(t, cfg)

	next := p.rotate(t)
	roots := x509.NewCertPool()
	roots.AddCert(firstCA.Cert)
	roots.AddCert(p.ca.Cert)
	clientCfg := &tls.Config{RootCAs: roots, ServerName: "konnectivity.example"}

	// p.rotate replaced the files but the check interval has not elapsed.
	old := dial(t, addr, clientCfg)
	if got := old.ConnectionState().PeerCertificates[0]; !got.Equal(first) {
		t.Fatal("first connection did not get the first certificate")
	}
	if err := roundTrip(old, "before"); err != nil {
		t.Fatal(err)
	}

	p.clock.Advance(checkInterval)
	fresh := dial(t, addr, clientCfg)
	if got := fresh.ConnectionState().PeerCertificates[0]; !got.Equal(next) {
		t.Fatalf("new connection got serial %x, want %x", got.SerialNumber, next.SerialNumber)
	}
	if err := roundTrip(fresh, "fresh"); err != nil {
		t.Fatal(err)
	}
	if err := roundTrip(old, "after"); err != nil {
		t.Fatalf("existing connection broke after rotation: %v", err)
	}
}

// TestServerConfigClientCARotation: the client CA bundle is looked up per
// handshake, so replacing it changes which agents are accepted.
func TestServerConfigClientCARotation(t *testing.T) {
	p := newPairEnv(t)
	dir := t.TempDir()
	caA, caB := newCA(t, "clients-a"), newCA(t, "clients-b")
	bundle := filepath.Join(dir, "clients.crt")
	writeFile(t, bundle, caA.CertPEM, 0o644)
	logs := &syncBuffer{}
	pool, err := NewCAPoolReloader(bundle, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	poolClock := newFakeClock()
	poolClock.install(&pool.t)
	cfg, err := ServerConfig(p.r, pool)
	if err != nil {
		t.Fatal(err)
	}
	addr := echoServer(t, cfg)

	clientFor := func(ca *CA) *tls.Config {
		certPEM, keyPEM, err := ca.Issue(Request{CommonName: "agent", Client: true})
		if err != nil {
			t.Fatal(err)
		}
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		roots := x509.NewCertPool()
		roots.AddCert(p.ca.Cert)
		// A session cache, so a resumption attempt after the rotation is
		// part of what is checked.
		return &tls.Config{RootCAs: roots, ServerName: "localhost", Certificates: []tls.Certificate{pair},
			ClientSessionCache: tls.NewLRUClientSessionCache(4)}
	}
	fromA, fromB := clientFor(caA), clientFor(caB)

	if err := roundTrip(dial(t, addr, fromA), "a"); err != nil {
		t.Fatalf("client from CA A refused: %v", err)
	}
	// With TLS 1.3 the client learns of a refused certificate on its first
	// read, so a round trip is the check.
	if err := roundTrip(dial(t, addr, fromB), "b"); err == nil {
		t.Fatal("client from CA B accepted before rotation")
	}

	if err := WriteFileAtomic(bundle, caB.CertPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	poolClock.Advance(checkInterval)
	if err := roundTrip(dial(t, addr, fromB), "b"); err != nil {
		t.Fatalf("client from CA B refused after rotation: %v", err)
	}
	if err := roundTrip(dial(t, addr, fromA), "a"); err == nil {
		t.Fatal("client from CA A still accepted after rotation")
	}
	mustContain(t, logs.String(), "CA bundle reloaded")

	// A bad bundle is refused; B stays trusted.
	writeFile(t, bundle, []byte("garbage"), 0o644)
	poolClock.Advance(checkInterval)
	if err := roundTrip(dial(t, addr, fromB), "b"); err != nil {
		t.Fatalf("bad bundle replaced the good one: %v", err)
	}
	mustContain(t, logs.String(), "refusing changed CA bundle")
}

func TestCAPoolReloader(t *testing.T) {
	dir := t.TempDir()
	caA, caB := newCA(t, "a"), newCA(t, "b")
	leaf := func(ca *CA) *x509.Certificate {
		certPEM, _, err := ca.Issue(Request{CommonName: "leaf", DNSNames: []string{"leaf.example"}})
		if err != nil {
			t.Fatal(err)
		}
		c, err := parseCertsPEM(certPEM)
		if err != nil {
			t.Fatal(err)
		}
		return c[0]
	}
	leafA, leafB := leaf(caA), leaf(caB)
	trusts := func(pool *x509.CertPool, c *x509.Certificate) bool {
		_, err := c.Verify(x509.VerifyOptions{Roots: pool, DNSName: "leaf.example"})
		return err == nil
	}
	file := filepath.Join(dir, "ca.crt")
	if _, err := NewCAPoolReloader(file, nil); err == nil {
		t.Fatal("missing bundle accepted")
	}
	writeFile(t, file, []byte("garbage"), 0o644)
	if _, err := NewCAPoolReloader(file, nil); err == nil {
		t.Fatal("garbage bundle accepted")
	}
	writeFile(t, file, caA.CertPEM, 0o644)
	p, err := NewCAPoolReloader(file, nil)
	if err != nil {
		t.Fatal(err)
	}
	clock := newFakeClock()
	clock.install(&p.t)
	if !trusts(p.Pool(), leafA) || trusts(p.Pool(), leafB) {
		t.Fatal("initial pool wrong")
	}
	// Bundle with both CAs (overlap during a CA rotation).
	if err := WriteFileAtomic(file, append(append([]byte{}, caA.CertPEM...), caB.CertPEM...), 0o644); err != nil {
		t.Fatal(err)
	}
	clock.Advance(checkInterval)
	if !trusts(p.Pool(), leafA) || !trusts(p.Pool(), leafB) {
		t.Fatal("overlap bundle not picked up")
	}
	writeFile(t, file, []byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"), 0o644)
	clock.Advance(checkInterval)
	if !trusts(p.Pool(), leafA) || !trusts(p.Pool(), leafB) {
		t.Fatal("bad bundle replaced the good pool")
	}
}

func TestServerConfigNeedsCert(t *testing.T) {
	if _, err := ServerConfig(nil, nil); err == nil {
		t.Fatal("ServerConfig without certificate succeeded")
	}
}

// TestReloaderStatNoise: a same-size in-place rewrite that keeps inode and
// mtime is still noticed while the file is recent (coarse timestamps, inode
// reuse), and settled files are judged by stat alone.
func TestReloaderStatNoise(t *testing.T) {
	p := newPairEnv(t)
	certA, keyA := readFile(t, p.certFile), readFile(t, p.keyFile)
	certB, keyB, err := p.ca.Issue(p.opts().Request)
	if err != nil {
		t.Fatal(err)
	}
	// PEM parsing ignores trailing text, so pad to equal sizes.
	pad := func(a, b []byte) ([]byte, []byte) {
		n := max(len(a), len(b))
		return append(append([]byte{}, a...), bytes.Repeat([]byte("\n"), n-len(a))...),
			append(append([]byte{}, b...), bytes.Repeat([]byte("\n"), n-len(b))...)
	}
	certA, certB = pad(certA, certB)
	keyA, keyB = pad(keyA, keyB)
	leafA, leafB := served(t, p.r), parseCertFile(t, writeTemp(t, certB))

	put := func(cert, key []byte, mtime time.Time) {
		t.Helper()
		writeFile(t, p.certFile, cert, 0o644) // in place: same inode
		writeFile(t, p.keyFile, key, 0o600)
		for _, f := range []string{p.certFile, p.keyFile} {
			if err := os.Chtimes(f, mtime, mtime); err != nil {
				t.Fatal(err)
			}
		}
		p.clock.Advance(checkInterval)
	}
	recent := time.Now().Truncate(time.Second)
	put(certA, keyA, recent)
	if !served(t, p.r).Equal(leafA) {
		t.Fatal("padding changed the served certificate")
	}
	put(certB, keyB, recent) // identical stamps, different content
	if !served(t, p.r).Equal(leafB) {
		t.Fatal("recent same-stamp rewrite was not noticed")
	}
	old := time.Now().Add(-time.Hour)
	put(certB, keyB, old)
	if !served(t, p.r).Equal(leafB) {
		t.Fatal("lost the pair")
	}
	put(certA, keyA, old) // settled and identical stamps: not re-read
	if !served(t, p.r).Equal(leafB) {
		t.Fatal("settled files were re-read although stat showed no change")
	}
}

func writeTemp(t *testing.T, data []byte) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "f")
	writeFile(t, f, data, 0o600)
	return f
}

// CheckValidity names what a peer that checks a pair's dates refuses: an
// expiry passed or a start not reached, the limits themselves inside.
func TestCheckValidity(t *testing.T) {
	p := newPairEnv(t)
	leaf := served(t, p.r)
	for _, tc := range []struct {
		at   time.Time
		want string
	}{
		{leaf.NotBefore, ""},
		{leaf.NotAfter, ""},
		{leaf.NotAfter.Add(time.Second), "expired at " + formatTime(leaf.NotAfter)},
		{leaf.NotBefore.Add(-time.Second), "not valid before " + formatTime(leaf.NotBefore)},
	} {
		got := ""
		if err := p.r.CheckValidity(tc.at); err != nil {
			got = err.Error()
		}
		if got != tc.want {
			t.Errorf("at %v: %q, want %q", tc.at, got, tc.want)
		}
	}
}
