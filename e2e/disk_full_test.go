package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestFaultCertRenewalDiskFull renews a pair with "konnectivity cert" on a
// disk (a tmpfs of 128 KiB in a private mount namespace) that has room for
// the new key but not the new certificate: the renewal fails, and the old
// pair is on disk exactly as it was, still a pair, with nothing left
// beside it. Once there is room, the same command renews.
func TestFaultCertRenewalDiskFull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a tmpfs in a mount namespace of its own")
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("unshare not installed")
	}
	dir := t.TempDir()
	caCert, caKey := writeTestCA(t, dir)
	disk := filepath.Join(dir, "disk")
	out := filepath.Join(dir, "out")
	for _, d := range []string{disk, out} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Enough names that the certificate takes two pages of the tmpfs and
	// the key one: with one page free the new key fits, the certificate not.
	var sans []string
	for i := range 250 {
		sans = append(sans, fmt.Sprintf("node-%03d.konnectivity.example", i))
	}
	script := `set -u
mount -t tmpfs -o size=128k tmpfs "$D" || exit 90
cert() { "$BIN" cert -ca-cert "$CA" -ca-key "$CAKEY" -dir "$D" -sans "$SANS" "$@"; }
cert -days 2 -renew-before 24h >"$O/first.txt" 2>&1 || exit 91
cp "$D/tls.crt" "$O/old.crt"; cp "$D/tls.key" "$O/old.key"
dd if=/dev/zero of="$D/fill" bs=4096 2>/dev/null
truncate -s -4096 "$D/fill"
cert -renew-before 72h >"$O/renew.txt" 2>&1; echo $? >"$O/renew.rc"
cp "$D/tls.crt" "$O/after.crt"; cp "$D/tls.key" "$O/after.key"
ls -A "$D" >"$O/ls.txt"
rm "$D/fill"
cert -renew-before 72h >"$O/renew2.txt" 2>&1; echo $? >"$O/renew2.rc"
cp "$D/tls.crt" "$O/final.crt"; cp "$D/tls.key" "$O/final.key"
`
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "unshare", "-m", "--propagation", "private", "sh", "-c", script)
	cmd.Env = append(os.Environ(), "D="+disk, "O="+out, "BIN="+konnectivityBin, "CA="+caCert, "CAKEY="+caKey, "SANS="+strings.Join(sans, ","))
	if b, err := cmd.CombinedOutput(); err != nil {
		first, _ := os.ReadFile(filepath.Join(out, "first.txt"))
		t.Fatalf("renewal on a full tmpfs: %v\n%s%s", err, b, first)
	}
	read := func(name string) []byte {
		b, err := os.ReadFile(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	if fi, err := os.Stat(filepath.Join(out, "old.crt")); err != nil || fi.Size() <= 4096 {
		t.Fatalf("the test's certificate must take more than one page: %v, %v bytes", err, fi.Size())
	}
	renew := string(read("renew.txt"))
	t.Logf("renewal on the full disk: exit %s: %s", bytes.TrimSpace(read("renew.rc")), strings.TrimSpace(renew))
	if strings.TrimSpace(string(read("renew.rc"))) == "0" || !strings.Contains(renew, "no space left") {
		t.Fatalf("the renewal on a full disk did not fail with ENOSPC: %s", renew)
	}
	if !bytes.Equal(read("after.key"), read("old.key")) {
		t.Error("the failed renewal replaced the key")
	}
	if !bytes.Equal(read("after.crt"), read("old.crt")) {
		t.Error("the failed renewal replaced the certificate")
	}
	if _, err := tls.X509KeyPair(read("after.crt"), read("after.key")); err != nil {
		t.Errorf("the pair left by the failed renewal does not load: %v", err)
	}
	if ls := strings.Fields(string(read("ls.txt"))); len(ls) != 3 {
		t.Errorf("the failed renewal left files beside the pair: %v", ls)
	}
	if strings.TrimSpace(string(read("renew2.rc"))) != "0" || !strings.Contains(string(read("renew2.txt")), "minted") {
		t.Fatalf("the renewal with room did not mint: %s", read("renew2.txt"))
	}
	if _, err := tls.X509KeyPair(read("final.crt"), read("final.key")); err != nil {
		t.Fatalf("the renewed pair does not load: %v", err)
	}
	if bytes.Equal(read("final.key"), read("old.key")) {
		t.Fatal("the renewal with room kept the old key")
	}
}

// writeTestCA writes a self-signed ECDSA CA and its key (SEC1) into dir.
func writeTestCA(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "konnectivity-e2e-disk-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
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
	certFile, keyFile = filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
	writePEM(t, certFile, "CERTIFICATE", der)
	writePEM(t, keyFile, "EC PRIVATE KEY", keyDER)
	return certFile, keyFile
}
