package certs

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// DefaultRenewBefore is used when EnsureOptions.RenewBefore is zero.
const DefaultRenewBefore = 30 * 24 * time.Hour

// EnsureOptions says which pair Ensure maintains and how.
type EnsureOptions struct {
	CertFile, KeyFile string
	CA                *CA
	Request           Request
	// RenewBefore re-mints a certificate expiring within this window; zero
	// means DefaultRenewBefore. It must be shorter than the validity, or
	// every run would mint again.
	RenewBefore time.Duration
	Now         func() time.Time // nil means time.Now
}

// Result reports what Ensure did.
type Result struct {
	Minted   bool
	Reason   string    // why the pair was reused or minted, e.g. "SANs changed (missing foo.example)"
	NotAfter time.Time // expiry of the pair now on disk
}

// Ensure makes sure CertFile/KeyFile hold a pair matching opts. An existing
// pair is reused when both files parse, the key matches the certificate, it
// is signed by opts.CA, its CN, SAN set (order-insensitive), usage and key
// type equal the request and it does not expire within RenewBefore.
// Otherwise a new pair is minted and written whole beside the old one
// before either is put in place (writePair); on any failure the old pair is
// left as it was.
func Ensure(opts EnsureOptions) (Result, error) {
	if opts.CertFile == "" || opts.KeyFile == "" {
		return Result{}, errors.New("ensure certificate: certificate and key paths are required")
	}
	if opts.CertFile == opts.KeyFile {
		return Result{}, fmt.Errorf("ensure certificate: certificate and key path are the same (%s)", opts.CertFile)
	}
	if opts.CA == nil || opts.CA.Cert == nil || opts.CA.Key == nil {
		return Result{}, errors.New("ensure certificate: no CA")
	}
	if err := opts.Request.validate(); err != nil {
		return Result{}, fmt.Errorf("ensure certificate: %w", err)
	}
	renewBefore := opts.RenewBefore
	if renewBefore == 0 {
		renewBefore = DefaultRenewBefore
	}
	if renewBefore < 0 {
		return Result{}, fmt.Errorf("ensure certificate: renew-before %v is negative", renewBefore)
	}
	if v := opts.Request.validity(); v <= renewBefore {
		return Result{}, fmt.Errorf("ensure certificate: validity %v must be longer than renew-before %v", v, renewBefore)
	}
	now := time.Now()
	if opts.Now != nil {
		now = opts.Now()
	}

	reason, notAfter, reuse := checkExisting(opts, renewBefore, now)
	if reuse {
		return Result{Reason: reason, NotAfter: notAfter}, nil
	}

	certPEM, keyPEM, cert, err := opts.CA.issueAt(opts.Request, now)
	if err != nil {
		return Result{}, fmt.Errorf("ensure certificate %s: %w", opts.CertFile, err)
	}
	for _, p := range []string{opts.CertFile, opts.KeyFile} {
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return Result{}, fmt.Errorf("ensure certificate: %w", err)
		}
	}
	if err := writePair(opts.CertFile, certPEM, opts.KeyFile, keyPEM); err != nil {
		return Result{}, fmt.Errorf("ensure certificate: %w", err)
	}
	if cert.NotAfter.Equal(opts.CA.Cert.NotAfter) {
		reason += fmt.Sprintf("; validity capped at CA expiry %s, rotate the CA", formatTime(cert.NotAfter))
	}
	return Result{Minted: true, Reason: reason, NotAfter: cert.NotAfter}, nil
}

// checkExisting decides whether the pair on disk can be kept. It returns the
// reason either way.
func checkExisting(opts EnsureOptions, renewBefore time.Duration, now time.Time) (reason string, notAfter time.Time, reuse bool) {
	certData, err := os.ReadFile(opts.CertFile)
	if errors.Is(err, fs.ErrNotExist) {
		return "no existing certificate", time.Time{}, false
	}
	if err != nil {
		return fmt.Sprintf("existing certificate unreadable (%v)", err), time.Time{}, false
	}
	keyData, err := os.ReadFile(opts.KeyFile)
	if errors.Is(err, fs.ErrNotExist) {
		return "no existing key", time.Time{}, false
	}
	if err != nil {
		return fmt.Sprintf("existing key unreadable (%v)", err), time.Time{}, false
	}
	certs, err := parseCertsPEM(certData)
	if err != nil {
		return fmt.Sprintf("existing certificate does not parse (%v)", err), time.Time{}, false
	}
	leaf := certs[0]
	key, err := parsePrivateKeyPEM(keyData)
	if err != nil {
		return fmt.Sprintf("existing key does not parse (%v)", err), time.Time{}, false
	}
	if !publicKeysEqual(leaf.PublicKey, key.Public()) {
		return "existing key does not match certificate", time.Time{}, false
	}
	// Belt and braces: the same check the daemons' TLS stack will make.
	if _, err := tls.X509KeyPair(certData, keyData); err != nil {
		return fmt.Sprintf("existing pair unusable (%v)", err), time.Time{}, false
	}
	if !signedBy(leaf, opts.CA.Cert) {
		return fmt.Sprintf("not signed by the current CA %q (CA rotated?)", opts.CA.Cert.Subject.CommonName), time.Time{}, false
	}
	req := opts.Request
	if leaf.Subject.CommonName != req.CommonName {
		return fmt.Sprintf("CN changed (was %q)", leaf.Subject.CommonName), time.Time{}, false
	}
	if d := sanDiff(leaf, req); d != "" {
		return "SANs changed (" + d + ")", time.Time{}, false
	}
	if u := usageOf(leaf); u != req.usage() {
		return fmt.Sprintf("usage changed (was %s)", u), time.Time{}, false
	}
	if kt := keyTypeOf(leaf.PublicKey); kt != req.keyType() {
		return fmt.Sprintf("key type changed (was %s)", kt), time.Time{}, false
	}
	if now.Before(leaf.NotBefore) {
		return fmt.Sprintf("not valid before %s", formatTime(leaf.NotBefore)), time.Time{}, false
	}
	if !now.Before(leaf.NotAfter) {
		return fmt.Sprintf("expired at %s", formatTime(leaf.NotAfter)), time.Time{}, false
	}
	if leaf.NotAfter.Sub(now) < renewBefore {
		if !leaf.NotAfter.Before(opts.CA.Cert.NotAfter) {
			// Already as long-lived as the CA allows; minting again would
			// not help and would repeat on every run.
			return fmt.Sprintf("valid until %s (capped at CA expiry, rotate the CA)", formatTime(leaf.NotAfter)), leaf.NotAfter, true
		}
		return fmt.Sprintf("expires %s, within renew-before %v", formatTime(leaf.NotAfter), renewBefore), time.Time{}, false
	}
	return fmt.Sprintf("valid until %s", formatTime(leaf.NotAfter)), leaf.NotAfter, true
}

// sanDiff describes how leaf's SANs differ from req's, or returns "".
func sanDiff(leaf *x509.Certificate, req Request) string {
	have := map[string]bool{}
	for _, d := range leaf.DNSNames {
		have[strings.ToLower(d)] = true
	}
	for _, ip := range leaf.IPAddresses {
		have[ip.String()] = true
	}
	want := map[string]bool{}
	for _, d := range req.DNSNames {
		want[strings.ToLower(d)] = true
	}
	for _, ip := range req.IPAddresses {
		want[ip.String()] = true
	}
	var missing, extra []string
	for k := range want {
		if !have[k] {
			missing = append(missing, k)
		}
	}
	for k := range have {
		if !want[k] {
			extra = append(extra, k)
		}
	}
	slices.Sort(missing)
	slices.Sort(extra)
	var parts []string
	if len(missing) > 0 {
		parts = append(parts, "missing "+strings.Join(missing, ", "))
	}
	if len(extra) > 0 {
		parts = append(parts, "unexpected "+strings.Join(extra, ", "))
	}
	// Leaf certificates may carry other SAN kinds (URIs, e-mails) we never
	// mint; treat them as a difference too.
	if len(leaf.URIs) > 0 || len(leaf.EmailAddresses) > 0 {
		parts = append(parts, "unexpected URI or e-mail SANs")
	}
	return strings.Join(parts, "; ")
}

// usageOf classifies leaf as "server", "client" or something else; a
// certificate carrying both or neither usage is not what Ensure mints.
func usageOf(leaf *x509.Certificate) string {
	server := slices.Contains(leaf.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	client := slices.Contains(leaf.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	switch {
	case server && !client:
		return "server"
	case client && !server:
		return "client"
	case server && client:
		return "server+client"
	}
	return "unspecified"
}

func formatTime(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// stageFile writes data, fsynced and with mode, to a new temporary file
// beside path and returns its name; on failure nothing is left behind.
func stageFile(path string, data []byte, mode os.FileMode) (_ string, err error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(tmp)
		}
	}()
	// CreateTemp makes the file 0600, so key bytes are never readable by
	// others; Chmod (unlike the open mode) is not reduced by the umask.
	if err := f.Chmod(mode); err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return "", fmt.Errorf("write %s: sync: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return "", fmt.Errorf("write %s: close: %w", path, err)
	}
	return tmp, nil
}

// syncDir persists the renames in path's directory; without it a crash can
// bring back the old directory entry (or none).
func syncDir(path string) error {
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return fmt.Errorf("write %s: open directory: %w", path, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("write %s: sync directory: %w", path, err)
	}
	return nil
}

// writePair puts a new certificate and key in place of the old pair, or
// leaves the old pair exactly as it was. Both new files are written whole
// and fsynced beside the old ones first, and the old key is kept under a
// second name, so a full disk or any other failure before the renames
// costs nothing. Then the key is renamed into place and the certificate
// after it; if the certificate's rename fails, the old key is renamed
// back. Readers (Reloader) read the certificate before the key, so the
// only mixed state one can see is the old certificate with the new key, a
// key mismatch that every loader refuses; a new certificate is never seen
// with the old key.
func writePair(certFile string, certPEM []byte, keyFile string, keyPEM []byte) (err error) {
	var tmps []string // removed on return; a rename takes its name out
	defer func() {
		for _, t := range tmps {
			if t != "" {
				_ = os.Remove(t)
			}
		}
	}()
	keyTmp, err := stageFile(keyFile, keyPEM, 0o600)
	if err != nil {
		return fmt.Errorf("write key: %w", err)
	}
	tmps = append(tmps, keyTmp)
	certTmp, err := stageFile(certFile, certPEM, 0o644)
	if err != nil {
		return fmt.Errorf("write certificate: %w", err)
	}
	tmps = append(tmps, certTmp)
	oldKey, err := keepOldKey(keyFile)
	if err != nil {
		return fmt.Errorf("write key: keep the old key: %w", err)
	}
	tmps = append(tmps, oldKey)
	if err := os.Rename(keyTmp, keyFile); err != nil {
		return fmt.Errorf("write key: %w", err)
	}
	tmps[0] = ""
	if err := os.Rename(certTmp, certFile); err != nil {
		// Put the old key back: the old pair again, as it was.
		if oldKey != "" {
			if rerr := os.Rename(oldKey, keyFile); rerr != nil {
				return fmt.Errorf("write certificate: %w; and restoring the old key %s failed: %v", err, keyFile, rerr)
			}
			tmps[2] = ""
		} else {
			_ = os.Remove(keyFile) // there was no pair: leave none
		}
		_ = syncDir(keyFile)
		return fmt.Errorf("write certificate: %w", err)
	}
	tmps[1] = ""
	if err := syncDir(keyFile); err != nil {
		return err
	}
	if filepath.Dir(certFile) != filepath.Dir(keyFile) {
		return syncDir(certFile)
	}
	return nil
}

// keepOldKey gives the key now at keyFile a second name beside it (a hard
// link, or where links are not allowed a copy), so that writePair can put
// it back; "" when there is no old key.
func keepOldKey(keyFile string) (string, error) {
	fi, err := os.Stat(keyFile)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	name := filepath.Join(filepath.Dir(keyFile), "."+filepath.Base(keyFile)+".old-"+strconv.FormatInt(time.Now().UnixNano(), 36))
	if os.Link(keyFile, name) == nil {
		return name, nil
	}
	data, err := os.ReadFile(keyFile)
	if err != nil {
		return "", err
	}
	return stageFile(keyFile, data, fi.Mode().Perm())
}
