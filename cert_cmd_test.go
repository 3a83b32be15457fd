package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestRunCert(t *testing.T) {
	dir := t.TempDir()
	caCert, caKey := k3sStyleCA(t, dir)
	out := filepath.Join(dir, "out")
	crt := filepath.Join(out, "tls.crt")
	base := []string{"-ca-cert", caCert, "--ca-key=" + caKey, "-dir", out, "-sans", "konnectivity.example,10.0.0.1"}

	code, stdout, stderr := runCertArgs(base...)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if want := "minted " + crt + ": no existing certificate\n"; stdout != want {
		t.Fatalf("stdout %q, want %q", stdout, want)
	}
	if v := opensslCmd(t, "verify", "-CAfile", caCert, "-purpose", "sslserver", crt); !strings.Contains(v, ": OK") {
		t.Fatal(v)
	}
	sans := opensslCmd(t, "x509", "-noout", "-ext", "subjectAltName", "-in", crt)
	if !strings.Contains(sans, "DNS:konnectivity.example") || !strings.Contains(sans, "IP Address:10.0.0.1") {
		t.Fatalf("SANs: %s", sans)
	}
	if fi, err := os.Stat(filepath.Join(out, "tls.key")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file: %v %v", fi, err)
	}

	code, stdout, _ = runCertArgs(base...)
	if code != 0 || !strings.HasPrefix(stdout, "reused "+crt+": valid until ") || strings.Count(stdout, "\n") != 1 {
		t.Fatalf("second run: exit %d, %q", code, stdout)
	}

	code, stdout, _ = runCertArgs(append(base, "-sans", "konnectivity.example,10.0.0.1,extra.example")...)
	if code != 0 || stdout != "minted "+crt+": SANs changed (missing extra.example)\n" {
		t.Fatalf("SAN change: exit %d, %q", code, stdout)
	}

	// Client certificate with explicit paths and another key type.
	agentCrt, agentKey := filepath.Join(dir, "agent.crt"), filepath.Join(dir, "agent.key")
	code, stdout, stderr = runCertArgs("-ca-cert", caCert, "-ca-key", caKey, "-client", "-cn", "konnectivity-agent",
		"-out-cert", agentCrt, "-out-key", agentKey, "-key-type", "rsa-2048", "-days", "30", "-renew-before", "240h")
	if code != 0 || !strings.HasPrefix(stdout, "minted "+agentCrt+": ") {
		t.Fatalf("client: exit %d, %q %s", code, stdout, stderr)
	}
	if v := opensslCmd(t, "verify", "-CAfile", caCert, "-purpose", "sslclient", agentCrt); !strings.Contains(v, ": OK") {
		t.Fatal(v)
	}
}

func TestRunCertBadInput(t *testing.T) {
	dir := t.TempDir()
	caCert, caKey := k3sStyleCA(t, dir)
	out := filepath.Join(dir, "out")
	ok := []string{"-ca-cert", caCert, "-ca-key", caKey, "-dir", out, "-sans", "a.example"}
	with := func(extra ...string) []string { return append(append([]string{}, ok...), extra...) }
	cases := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"no CA", []string{"-dir", out, "-sans", "a.example"}, 1, "-ca-cert and -ca-key are required"},
		{"no output", []string{"-ca-cert", caCert, "-ca-key", caKey, "-sans", "a.example"}, 1, "give -dir"},
		{"empty SAN entry", with("-sans", "a.example,"), 1, "-sans: SAN list"},
		{"invalid SAN", with("-sans", "bad name"), 1, "invalid DNS name"},
		{"no SANs for server", with("-sans", ""), 1, "needs at least one DNS or IP SAN"},
		{"zero days", with("-days", "0"), 1, "-days must be positive"},
		{"renew-before too long", with("-days", "10"), 1, "must be longer than renew-before"},
		{"bad key type", with("-key-type", "dsa"), 1, `unknown key type "dsa"`},
		{"missing CA file", with("-ca-cert", filepath.Join(dir, "nope.crt")), 1, "read CA certificate"},
		{"key is not the CA's", with("-ca-key", filepath.Join(dir, "ca.cnf")), 1, "no private key PEM block"},
		{"unknown flag", with("-bogus"), 2, "unknown flag --bogus; 'konnectivity cert --help' lists the flags"},
		{"bad duration", with("-renew-before", "soon"), 2, "invalid value"},
		{"stray argument", with("extra"), 2, "unexpected arguments"},
	}
	for _, c := range cases {
		code, stdout, stderr := runCertArgs(c.args...)
		if code != c.code || !strings.Contains(stderr, c.want) || stdout != "" {
			t.Errorf("%s: exit %d (want %d), stdout %q, stderr %q (want %q)", c.name, code, c.code, stdout, stderr, c.want)
		}
	}
	if _, err := os.Stat(out); err == nil {
		t.Error("a failed run created the output directory")
	}
	if code, stdout, _ := runCertArgs("-h"); code != 0 || !strings.Contains(stdout, "-renew-before") || !strings.HasPrefix(stdout, "Usage: konnectivity cert") {
		t.Errorf("-h: exit %d, %q", code, stdout)
	}
}
