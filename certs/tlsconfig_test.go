package certs

import (
	"crypto/tls"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
)

// TestReloadingServerConfig: the config serves the pair, asks clients for
// a certificate when a CA file is given, keeps the minimum version, and an
// error names the flag that gave the broken file.
func TestReloadingServerConfig(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	e := newEnsureEnv(t)
	e.ensure(t, e.opts())
	f := ServerFiles{Listener: "agents", CertFile: e.certFile, KeyFile: e.keyFile, CAFile: e.caFile, PairFlags: "--cluster-cert/--cluster-key", CAFlag: "--cluster-ca-cert"}
	cfg, r, err := ReloadingServerConfig(f, tls.VersionTLS13, log)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.MinVersion != tls.VersionTLS13 || cfg.ClientAuth != tls.RequireAndVerifyClientCert || served(t, r) == nil {
		t.Errorf("MinVersion %x, ClientAuth %v", cfg.MinVersion, cfg.ClientAuth)
	}
	missing := filepath.Join(e.dir, "missing.crt")
	for _, tc := range []struct {
		f    ServerFiles
		want string
	}{
		{ServerFiles{CertFile: missing, KeyFile: e.keyFile, PairFlags: f.PairFlags}, "--cluster-cert/--cluster-key: "},
		{ServerFiles{CertFile: e.certFile, KeyFile: e.keyFile, CAFile: missing, CAFlag: f.CAFlag}, "--cluster-ca-cert: "},
	} {
		if _, _, err := ReloadingServerConfig(tc.f, tls.VersionTLS12, log); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%+v: err %v, want it to start with %q", tc.f, err, tc.want)
		}
	}
}

// TestLoadCAPool: a bundle is read; a file without a certificate is refused.
func TestLoadCAPool(t *testing.T) {
	e := newEnsureEnv(t)
	if pool, err := LoadCAPool(e.caFile); err != nil || pool == nil {
		t.Fatalf("LoadCAPool(%s): %v", e.caFile, err)
	}
	empty := filepath.Join(e.dir, "empty.crt")
	writeFile(t, empty, []byte("not PEM\n"), 0o644)
	if _, err := LoadCAPool(empty); err == nil || !strings.Contains(err.Error(), "no PEM certificate found") {
		t.Errorf("LoadCAPool(not PEM): err %v", err)
	}
}

// TestCipherSuiteIDs: Go's names are read in order; an insecure or an
// unknown name is refused, naming it.
func TestCipherSuiteIDs(t *testing.T) {
	ids, err := CipherSuiteIDs([]string{"TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", "TLS_AES_128_GCM_SHA256"})
	if err != nil || len(ids) != 2 || ids[0] != tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 || ids[1] != tls.TLS_AES_128_GCM_SHA256 {
		t.Errorf("ids %v, err %v", ids, err)
	}
	for name, want := range map[string]string{
		"TLS_RSA_WITH_RC4_128_SHA": "TLS_RSA_WITH_RC4_128_SHA is insecure",
		"TLS_NO_SUCH_SUITE":        "TLS_NO_SUCH_SUITE is not a cipher suite",
	} {
		if _, err := CipherSuiteIDs([]string{name}); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: err %v, want %q", name, err, want)
		}
	}
	if ids, err := CipherSuiteIDs(nil); err != nil || ids != nil {
		t.Errorf("no names: %v, %v; want Go's defaults (nil)", ids, err)
	}
}
