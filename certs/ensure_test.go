package certs

import (
	"bytes"
	"crypto"
	"crypto/tls"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func expectReused(t *testing.T, res Result) {
	t.Helper()
	if res.Minted {
		t.Fatalf("minted (%s), want reuse", res.Reason)
	}
	mustContain(t, res.Reason, "valid until ")
	mustContain(t, res.String(), "reused: valid until ")
}

func TestEnsureMintThenReuse(t *testing.T) {
	e := newEnsureEnv(t)
	o := e.opts()
	res := e.ensure(t, o)
	expectMinted(t, res, "no existing certificate")
	e.verify(t, o)
	for p, want := range map[string]os.FileMode{e.keyFile: 0o600, e.certFile: 0o644} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Fatalf("%s mode %v, want %v", p, fi.Mode().Perm(), want)
		}
	}
	before := readFile(t, e.certFile)

	res = e.ensure(t, o)
	expectReused(t, res)
	mustContain(t, res.Reason, res.NotAfter.UTC().Format(time.RFC3339))

	// SAN order and DNS case do not matter.
	o.Request.DNSNames = []string{"LOCALHOST", "konnectivity.example"}
	expectReused(t, e.ensure(t, o))
	if string(readFile(t, e.certFile)) != string(before) {
		t.Fatal("reuse rewrote the certificate")
	}
}

func TestEnsureRemintRules(t *testing.T) {
	cases := []struct {
		name   string
		mutate func(t *testing.T, e *ensureEnv, o *EnsureOptions)
		want   string
		real   bool // minted as of the real clock, so openssl can verify it
	}{
		{"SAN added", func(_ *testing.T, _ *ensureEnv, o *EnsureOptions) {
			o.Request.DNSNames = append(o.Request.DNSNames, "new.example")
		}, "SANs changed (missing new.example)", true},
		{"SAN removed", func(_ *testing.T, _ *ensureEnv, o *EnsureOptions) {
			o.Request.IPAddresses = nil
		}, "SANs changed (unexpected 127.0.0.1)", true},
		{"IP changed", func(_ *testing.T, _ *ensureEnv, o *EnsureOptions) {
			o.Request.IPAddresses = []net.IP{net.ParseIP("::1")}
		}, "missing ::1; unexpected 127.0.0.1", true},
		{"CN changed", func(_ *testing.T, _ *ensureEnv, o *EnsureOptions) {
			o.Request.CommonName = "other"
		}, `CN changed (was "konnectivity-server")`, true},
		{"CA rotated", func(t *testing.T, e *ensureEnv, o *EnsureOptions) {
			e.ca = newCA(t, "rotated-ca")
			e.caFile, _ = writeCA(t, e.dir, e.ca)
			o.CA = e.ca
		}, `not signed by the current CA "rotated-ca"`, true},
		{"near expiry", func(_ *testing.T, _ *ensureEnv, o *EnsureOptions) {
			o.Now = func() time.Time { return time.Now().Add(340 * 24 * time.Hour) }
		}, "within renew-before 720h0m0s", false},
		{"expired", func(_ *testing.T, _ *ensureEnv, o *EnsureOptions) {
			o.Now = func() time.Time { return time.Now().Add(400 * 24 * time.Hour) }
		}, "expired at", false},
		{"key mismatch", func(t *testing.T, e *ensureEnv, _ *EnsureOptions) {
			_, otherKey, err := e.ca.Issue(Request{CommonName: "x", Client: true})
			if err != nil {
				t.Fatal(err)
			}
			writeFile(t, e.keyFile, otherKey, 0o600)
		}, "existing key does not match certificate", true},
		{"usage server to client", func(_ *testing.T, _ *ensureEnv, o *EnsureOptions) {
			o.Request.Client = true
		}, "usage changed (was server)", true},
		{"key type", func(_ *testing.T, _ *ensureEnv, o *EnsureOptions) {
			o.Request.KeyType = KeyEd25519
		}, "key type changed (was ecdsa-p256)", true},
		{"corrupt cert", func(t *testing.T, e *ensureEnv, _ *EnsureOptions) {
			data := readFile(t, e.certFile)
			writeFile(t, e.certFile, data[:len(data)/2], 0o644)
		}, "existing certificate does not parse", true},
		{"corrupt key", func(t *testing.T, e *ensureEnv, _ *EnsureOptions) {
			writeFile(t, e.keyFile, []byte("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"), 0o600)
		}, "existing key does not parse", true},
		{"missing key", func(t *testing.T, e *ensureEnv, _ *EnsureOptions) {
			if err := os.Remove(e.keyFile); err != nil {
				t.Fatal(err)
			}
		}, "no existing key", true},
		{"missing cert", func(t *testing.T, e *ensureEnv, _ *EnsureOptions) {
			if err := os.Remove(e.certFile); err != nil {
				t.Fatal(err)
			}
		}, "no existing certificate", true},
		{"cert unreadable", func(t *testing.T, e *ensureEnv, _ *EnsureOptions) {
			// A directory in place of the file is unreadable even for root;
			// minting then fails to replace it, which Ensure reports.
			if err := os.Remove(e.certFile); err != nil {
				t.Fatal(err)
			}
			if err := os.Mkdir(e.certFile, 0o755); err != nil {
				t.Fatal(err)
			}
		}, "", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newEnsureEnv(t)
			o := e.opts()
			expectMinted(t, e.ensure(t, o), "no existing certificate")
			c.mutate(t, e, &o)
			if c.name == "cert unreadable" {
				_, err := Ensure(o)
				if err == nil {
					t.Fatal("Ensure succeeded with a directory as certificate path")
				}
				mustContain(t, err.Error(), "write certificate")
				return
			}
			expectMinted(t, e.ensure(t, o), c.want)
			if c.real {
				e.verify(t, o)
			}
			// The new pair is stable under the same options.
			expectReused(t, e.ensure(t, o))
		})
	}
}

func TestEnsureCappedAtCAExpiry(t *testing.T) {
	e := newEnsureEnv(t)
	now := time.Now()
	e.ca = caWithDates(t, "short-ca", now.Add(-time.Hour), now.Add(10*24*time.Hour))
	e.caFile, _ = writeCA(t, e.dir, e.ca)
	o := e.opts()
	o.CA = e.ca
	res := e.ensure(t, o)
	expectMinted(t, res, "validity capped at CA expiry")
	e.verify(t, o)
	// Expiring within renew-before, but minting again cannot help: reuse.
	res = e.ensure(t, o)
	if res.Minted {
		t.Fatalf("minted again: %s", res.Reason)
	}
	mustContain(t, res.Reason, "capped at CA expiry, rotate the CA")
}

func TestEnsureBadOptions(t *testing.T) {
	e := newEnsureEnv(t)
	cases := map[string]func(o *EnsureOptions){
		"no CA":           func(o *EnsureOptions) { o.CA = nil },
		"no cert path":    func(o *EnsureOptions) { o.CertFile = "" },
		"same paths":      func(o *EnsureOptions) { o.KeyFile = o.CertFile },
		"short validity":  func(o *EnsureOptions) { o.Request.Validity = 720 * time.Hour },
		"negative renew":  func(o *EnsureOptions) { o.RenewBefore = -time.Hour },
		"no SANs":         func(o *EnsureOptions) { o.Request.DNSNames, o.Request.IPAddresses = nil, nil },
		"bad key type":    func(o *EnsureOptions) { o.Request.KeyType = "rsa-1024" },
		"empty CN":        func(o *EnsureOptions) { o.Request.CommonName = "" },
		"invalid DNS SAN": func(o *EnsureOptions) { o.Request.DNSNames = []string{"bad name"} },
	}
	for name, mut := range cases {
		o := e.opts()
		mut(&o)
		if _, err := Ensure(o); err == nil {
			t.Errorf("%s: Ensure succeeded", name)
		}
	}
	if _, err := os.Stat(e.certFile); err == nil {
		t.Fatal("a rejected Ensure wrote a certificate")
	}
}

// TestEnsureInterruptedWrite simulates crashes: leftover temporary files
// from an interrupted write, and a crash between writing the new
// key and the new certificate.
func TestEnsureInterruptedWrite(t *testing.T) {
	e := newEnsureEnv(t)
	o := e.opts()
	e.ensure(t, o)
	out := filepath.Dir(e.certFile)
	// What a crash before rename leaves behind: partial temp files.
	key := readFile(t, e.keyFile)
	writeFile(t, filepath.Join(out, ".tls.key.tmp-123456"), key[:len(key)/3], 0o600)
	writeFile(t, filepath.Join(out, ".tls.crt.tmp-654321"), []byte("-----BEGIN CERT"), 0o600)
	if _, err := tls.LoadX509KeyPair(e.certFile, e.keyFile); err != nil {
		t.Fatalf("old pair no longer loads: %v", err)
	}
	expectReused(t, e.ensure(t, o))

	// Crash after the key was replaced, before the certificate was.
	_, newKey, err := e.ca.Issue(Request{CommonName: "x", DNSNames: []string{"x.example"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteFileAtomic(e.keyFile, newKey, 0o600); err != nil {
		t.Fatal(err)
	}
	expectMinted(t, e.ensure(t, o), "existing key does not match certificate")
	e.verify(t, o)
	expectReused(t, e.ensure(t, o))
}

// TestStageFile: a staged file holds the data with the mode asked for
// (not reduced by the umask), fsynced beside its path under a hidden
// temporary name, and its path is not touched.
func TestStageFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	tmp, err := stageFile(p, []byte("two"), 0o644)
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Dir(tmp) != dir || !strings.HasPrefix(filepath.Base(tmp), ".f.tmp-") {
		t.Fatalf("staged as %s, want .f.tmp-* in %s", tmp, dir)
	}
	if got := string(readFile(t, tmp)); got != "two" {
		t.Fatalf("content %q", got)
	}
	fi, err := os.Stat(tmp)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o644 {
		t.Fatalf("mode %v", fi.Mode().Perm())
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Fatalf("staging touched %s: %v", p, err)
	}
	if _, err := stageFile(filepath.Join(dir, "missing", "f"), []byte("x"), 0o600); err == nil {
		t.Fatal("staging into a missing directory succeeded")
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 || entries[0].Name() != filepath.Base(tmp) {
		t.Fatalf("files in %s: %v, want only the staged one", dir, entries)
	}
}

// TestEnsureFailedRenameKeepsOldPair makes the certificate's rename fail
// after the key's went through (the certificate's path is a directory):
// the old key is put back, and no temporary file or second name is left.
func TestEnsureFailedRenameKeepsOldPair(t *testing.T) {
	e := newEnsureEnv(t)
	o := e.opts()
	e.ensure(t, o)
	oldKey := readFile(t, e.keyFile)
	if err := os.Remove(e.certFile); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(e.certFile, "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := Ensure(o); err == nil || !strings.Contains(err.Error(), "write certificate") {
		t.Fatalf("Ensure with a directory in the certificate's place: %v, want a write certificate error", err)
	}
	if got := readFile(t, e.keyFile); !bytes.Equal(got, oldKey) {
		t.Fatal("the old key was not put back after the certificate's rename failed")
	}
	fi, err := os.Stat(e.keyFile)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("restored key mode %v", fi.Mode().Perm())
	}
	noLeftovers(t, filepath.Dir(e.keyFile))

	// No pair before: a failure leaves none, not a lone key.
	e2 := newEnsureEnv(t)
	if err := os.MkdirAll(filepath.Join(e2.certFile, "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := Ensure(e2.opts()); err == nil {
		t.Fatal("Ensure with a directory in the certificate's place succeeded")
	}
	if _, err := os.Stat(e2.keyFile); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a failed first mint left a key: %v", err)
	}
	noLeftovers(t, filepath.Dir(e2.keyFile))
}

// TestEnsureRenewalNeverMismatched renews a pair again and again while
// readers load it as a daemon does at start (NewReloader) and as a running
// one does (a Reloader's refresh): every load succeeds and serves a
// certificate with its own key.
func TestEnsureRenewalNeverMismatched(t *testing.T) {
	e := newEnsureEnv(t)
	o := e.opts()
	e.ensure(t, o)
	r, err := NewReloader(e.certFile, e.keyFile, nil)
	if err != nil {
		t.Fatal(err)
	}
	r.t.interval = 0 // check the files on every handshake
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := NewReloader(e.certFile, e.keyFile, nil); err != nil {
				errs <- fmt.Errorf("fresh load during a renewal: %w", err)
				return
			}
			c := r.current()
			if !publicKeysEqual(c.Leaf.PublicKey, c.PrivateKey.(crypto.Signer).Public()) {
				errs <- errors.New("the Reloader serves a certificate with another key")
				return
			}
		}
	}()
	for i := range 30 {
		oi := o
		oi.Request.DNSNames = []string{"konnectivity.example", fmt.Sprintf("renewal-%d.example", i)}
		if _, err := Ensure(oi); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	noLeftovers(t, filepath.Dir(e.keyFile))
}

func noLeftovers(t *testing.T, dir string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, en := range entries {
		if strings.HasPrefix(en.Name(), ".") {
			t.Fatalf("%s left behind in %s", en.Name(), dir)
		}
	}
}
