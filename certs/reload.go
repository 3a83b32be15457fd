package certs

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// checkInterval bounds how often the handshake path stats the files.
const checkInterval = time.Second

// fileStamp identifies one version of a file cheaply. Atomic replacement
// changes the inode; in-place rewrites change mtime or size.
type fileStamp struct {
	mod  time.Time
	size int64
	ino  uint64
}

func stampOf(path string) (fileStamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	return fileStamp{mod: fi.ModTime(), size: fi.Size(), ino: inode(fi)}, nil
}

// settleTime is how long after its mtime a file's stamp is trusted alone.
// Timestamps are coarse (a jiffy on ext4, a second on older file systems)
// and a freed inode number can be reused by the next atomic replacement, so
// two quick same-size writes may look identical to stat; while a file is this
// recent, its content is compared as well.
const settleTime = 2 * time.Second

func (s fileStamp) settled() bool { return time.Since(s.mod) > settleTime }

// throttle decides on the handshake path whether a file check is due.
type throttle struct {
	now       func() time.Time
	interval  time.Duration
	lastCheck time.Time
	lastErr   string // last logged failure, so an unchanged problem is logged once
}

func (t *throttle) due() bool {
	now := t.now()
	if d := now.Sub(t.lastCheck); !t.lastCheck.IsZero() && d >= 0 && d < t.interval {
		return false
	}
	t.lastCheck = now
	return true
}

// warnOnce logs err unless it is the same failure as last time.
func (t *throttle) warnOnce(logger *slog.Logger, msg string, err error, attrs ...any) {
	if err.Error() == t.lastErr {
		return
	}
	t.lastErr = err.Error()
	logger.Warn(msg, append(attrs, "err", err)...)
}

func orDiscard(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l
}

// Reloader serves a certificate/key pair from disk and picks up replaced
// files without a restart: a server's tls.Config takes its GetCertificate.
// At most once per second a handshake stats both files (mtime, size,
// inode); when either changed, or was modified in the last couple of
// seconds, the pair is re-read, and a pair that does not load (unparsable,
// key mismatch) is refused with a log line while the previous one keeps
// serving. No goroutine is involved.
type Reloader struct {
	certFile, keyFile string
	logger            *slog.Logger

	mu        sync.Mutex
	t         throttle
	cert      *tls.Certificate
	certPEM   []byte // files behind cert, to tell real changes from stat noise
	keyPEM    []byte
	certStamp fileStamp
	keyStamp  fileStamp
}

// loadRetry is how often NewReloader reads a fresh pair again that does
// not load.
const loadRetry = 100 * time.Millisecond

// NewReloader loads the pair and fails if it is unusable. A pair that does
// not load while either file is younger than settleTime is read again
// until it loads or settles: it may be half way through its replacement.
func NewReloader(certFile, keyFile string, logger *slog.Logger) (*Reloader, error) {
	r := &Reloader{
		certFile: certFile,
		keyFile:  keyFile,
		logger:   orDiscard(logger),
		t:        throttle{now: time.Now, interval: checkInterval},
	}
	var (
		cs, ks          fileStamp
		certPEM, keyPEM []byte
		c               *tls.Certificate
		err             error
	)
	for tries := 0; ; tries++ {
		if cs, ks, err = r.stamps(); err != nil {
			return nil, err
		}
		if certPEM, keyPEM, err = readPair(certFile, keyFile); err != nil {
			return nil, err
		}
		c, err = parsePair(certFile, keyFile, certPEM, keyPEM)
		if err == nil {
			break
		}
		// A pair being replaced (Ensure renames the key, then the
		// certificate) is a mismatch for an instant; a fresh file is given
		// until it settles to become whole.
		if tries >= int(settleTime/loadRetry) || (cs.settled() && ks.settled()) {
			return nil, err
		}
		time.Sleep(loadRetry)
	}
	r.cert, r.certPEM, r.keyPEM, r.certStamp, r.keyStamp = c, certPEM, keyPEM, cs, ks
	r.t.lastCheck = r.t.now()
	r.logLoaded("TLS certificate loaded", c)
	return r, nil
}

// GetCertificate implements tls.Config.GetCertificate.
func (r *Reloader) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	return r.current(), nil
}

// NotAfter is the expiry of the pair currently served.
func (r *Reloader) NotAfter() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cert.Leaf.NotAfter
}

// CheckValidity fails when the pair served now is outside its validity
// at now (see the package function CheckValidity).
func (r *Reloader) CheckValidity(now time.Time) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return CheckValidity(r.cert.Leaf, now)
}

// CheckValidity says why leaf is refused by a peer that checks it at now
// (crypto/x509 does): it expired, or it is not valid yet. A pair that
// loads is served whatever its dates, so that rotated files are picked up
// without a restart; what refuses one out of its validity is the check of
// a restart (docs/restart.md), which would lose every peer the running
// image holds.
func CheckValidity(leaf *x509.Certificate, now time.Time) error {
	switch {
	case now.After(leaf.NotAfter):
		return fmt.Errorf("expired at %s", formatTime(leaf.NotAfter))
	case now.Before(leaf.NotBefore):
		return fmt.Errorf("not valid before %s", formatTime(leaf.NotBefore))
	}
	return nil
}

func (r *Reloader) current() *tls.Certificate {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.t.due() {
		r.refresh()
	}
	return r.cert
}

func (r *Reloader) stamps() (cert, key fileStamp, err error) {
	if cert, err = stampOf(r.certFile); err != nil {
		return cert, key, fmt.Errorf("TLS certificate: %w", err)
	}
	if key, err = stampOf(r.keyFile); err != nil {
		return cert, key, fmt.Errorf("TLS key: %w", err)
	}
	return cert, key, nil
}

// refresh reloads the pair if the files changed. Callers hold r.mu.
func (r *Reloader) refresh() {
	// Stat before reading: if the files change while being read, the stamps
	// are stale and the next check reads them again.
	cs, ks, err := r.stamps()
	if err != nil {
		r.t.warnOnce(r.logger, "cannot check TLS certificate files, keeping the current pair", err, "cert", r.certFile)
		return
	}
	if cs == r.certStamp && ks == r.keyStamp && cs.settled() && ks.settled() {
		return
	}
	r.certStamp, r.keyStamp = cs, ks
	certPEM, keyPEM, err := readPair(r.certFile, r.keyFile)
	if err == nil && bytes.Equal(certPEM, r.certPEM) && bytes.Equal(keyPEM, r.keyPEM) {
		return
	}
	var c *tls.Certificate
	if err == nil {
		c, err = parsePair(r.certFile, r.keyFile, certPEM, keyPEM)
	}
	if err != nil {
		r.t.warnOnce(r.logger, "refusing changed TLS certificate files, keeping the current pair", err, "cert", r.certFile, "key", r.keyFile)
		return
	}
	r.t.lastErr = ""
	r.cert, r.certPEM, r.keyPEM = c, certPEM, keyPEM
	r.logLoaded("TLS certificate reloaded", c)
}

func (r *Reloader) logLoaded(msg string, c *tls.Certificate) {
	r.logger.Info(msg, "cert", r.certFile, "subject", c.Leaf.Subject.CommonName,
		"serial", c.Leaf.SerialNumber.Text(16), "notAfter", formatTime(c.Leaf.NotAfter))
	if time.Now().After(c.Leaf.NotAfter) {
		r.logger.Warn("TLS certificate is expired", "cert", r.certFile, "notAfter", formatTime(c.Leaf.NotAfter))
	}
}

// readPair reads the certificate before the key, matching the writer's
// key-then-certificate order (see the package documentation).
func readPair(certFile, keyFile string) (certPEM, keyPEM []byte, err error) {
	if certPEM, err = os.ReadFile(certFile); err != nil {
		return nil, nil, fmt.Errorf("read TLS certificate: %w", err)
	}
	if keyPEM, err = os.ReadFile(keyFile); err != nil {
		return nil, nil, fmt.Errorf("read TLS key: %w", err)
	}
	return certPEM, keyPEM, nil
}

func parsePair(certFile, keyFile string, certPEM, keyPEM []byte) (*tls.Certificate, error) {
	c, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("load TLS pair %s, %s: %w", certFile, keyFile, err)
	}
	if c.Leaf == nil {
		// GODEBUG=x509keypairleaf=0 leaves Leaf unset.
		if c.Leaf, err = x509.ParseCertificate(c.Certificate[0]); err != nil {
			return nil, fmt.Errorf("load TLS pair %s: %w", certFile, err)
		}
	}
	return &c, nil
}

// CAPoolReloader serves a CA bundle from disk as an x509.CertPool, re-reading
// the file (at most once per second) when it changed. A changed file that
// does not parse is refused with a log line and the previous pool is kept.
type CAPoolReloader struct {
	file   string
	logger *slog.Logger

	mu    sync.Mutex
	t     throttle
	pool  *x509.CertPool
	data  []byte // file behind pool
	stamp fileStamp
}

// NewCAPoolReloader loads file and fails if it holds no valid certificate.
func NewCAPoolReloader(file string, logger *slog.Logger) (*CAPoolReloader, error) {
	p := &CAPoolReloader{
		file:   file,
		logger: orDiscard(logger),
		t:      throttle{now: time.Now, interval: checkInterval},
	}
	st, err := stampOf(file)
	if err != nil {
		return nil, fmt.Errorf("CA bundle: %w", err)
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("read CA bundle: %w", err)
	}
	pool, n, err := parsePool(file, data)
	if err != nil {
		return nil, err
	}
	p.pool, p.data, p.stamp = pool, data, st
	p.t.lastCheck = p.t.now()
	p.logger.Info("CA bundle loaded", "file", file, "certificates", n)
	return p, nil
}

// Pool returns the current pool. Callers must not modify it.
func (p *CAPoolReloader) Pool() *x509.CertPool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.t.due() {
		p.refresh()
	}
	return p.pool
}

func (p *CAPoolReloader) refresh() {
	st, err := stampOf(p.file)
	if err != nil {
		p.t.warnOnce(p.logger, "cannot check CA bundle, keeping the current one", err, "file", p.file)
		return
	}
	if st == p.stamp && st.settled() {
		return
	}
	p.stamp = st
	data, err := os.ReadFile(p.file)
	if err == nil && bytes.Equal(data, p.data) {
		return
	}
	var pool *x509.CertPool
	var n int
	if err == nil {
		pool, n, err = parsePool(p.file, data)
	}
	if err != nil {
		p.t.warnOnce(p.logger, "refusing changed CA bundle, keeping the current one", err, "file", p.file)
		return
	}
	p.t.lastErr = ""
	p.pool, p.data = pool, data
	p.logger.Info("CA bundle reloaded", "file", p.file, "certificates", n)
}

func parsePool(file string, data []byte) (*x509.CertPool, int, error) {
	certs, err := parseCertsPEM(data)
	if err != nil {
		return nil, 0, fmt.Errorf("parse CA bundle %s: %w", file, err)
	}
	pool := x509.NewCertPool()
	for _, c := range certs {
		pool.AddCert(c)
	}
	return pool, len(certs), nil
}

// ServerConfig returns a TLS 1.2+ server config presenting cert's current
// pair. When clientCAs is non-nil, clients must present a certificate that
// chains to clientCAs' current bundle; the bundle is looked up per handshake
// so a rotated CA file applies to new connections. Fields the caller sets on
// the returned config later (NextProtos, MinVersion, ...) are honoured.
func ServerConfig(cert *Reloader, clientCAs *CAPoolReloader) (*tls.Config, error) {
	if cert == nil {
		return nil, errors.New("TLS server config: no certificate")
	}
	base := &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: cert.GetCertificate}
	if clientCAs == nil {
		return base, nil
	}
	base.ClientAuth = tls.RequireAndVerifyClientCert
	// Some Go releases resumed TLS sessions without re-checking the client
	// certificate against a ClientCAs changed by GetConfigForClient, letting
	// a ticket from before a CA rotation back in. Peers here hold long-lived
	// connections, so resumption buys little; turn it off.
	base.SessionTicketsDisabled = true
	base.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		c := base.Clone()
		c.GetConfigForClient = nil
		c.ClientCAs = clientCAs.Pool()
		return c, nil
	}
	return base, nil
}
