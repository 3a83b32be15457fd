package certs

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rsa"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestOpenSSLCAs loads CAs whose keys openssl wrote in every supported
// encoding, mints serving certificates of every key type and a client
// certificate, and has openssl verify the chain, purpose, SANs and key.
func TestOpenSSLCAs(t *testing.T) {
	kinds := []struct {
		kind    string
		keyType any
	}{
		{"rsa-pkcs1", &rsa.PrivateKey{}},
		{"rsa-pkcs8", &rsa.PrivateKey{}},
		{"ec-sec1", &ecdsa.PrivateKey{}},
		{"ec-sec1-params", &ecdsa.PrivateKey{}},
		{"ec-pkcs8", &ecdsa.PrivateKey{}},
		{"ed25519", ed25519.PrivateKey{}},
	}
	for _, k := range kinds {
		t.Run(k.kind, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			keyFile := opensslKey(t, dir, k.kind)
			caFile := opensslCert(t, dir, keyFile, "ca-"+k.kind, "ca")
			ca, err := LoadCA(caFile, keyFile)
			if err != nil {
				t.Fatalf("LoadCA: %v", err)
			}
			if got, want := typeName(ca.Key), typeName(k.keyType); got != want {
				t.Fatalf("CA key type %s, want %s", got, want)
			}
			if ca.Cert.Subject.CommonName != "ca-"+k.kind {
				t.Fatalf("CA CN %q", ca.Cert.Subject.CommonName)
			}
			reqs := []Request{
				{CommonName: "srv-ec", DNSNames: []string{"konnectivity.example", "Localhost"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1")}},
				{CommonName: "srv-rsa", DNSNames: []string{"a.example"}, KeyType: KeyRSA2048},
				{CommonName: "srv-ed", IPAddresses: []net.IP{net.ParseIP("10.1.2.3")}, KeyType: KeyEd25519},
				{CommonName: "agent", Client: true},
			}
			for _, req := range reqs {
				certPEM, keyPEM, err := ca.Issue(req)
				if err != nil {
					t.Fatalf("Issue %s: %v", req.CommonName, err)
				}
				if !strings.HasPrefix(string(keyPEM), "-----BEGIN PRIVATE KEY-----") {
					t.Fatalf("key is not PKCS#8 PEM: %.40s", keyPEM)
				}
				cf := filepath.Join(dir, req.CommonName+".crt")
				kf := filepath.Join(dir, req.CommonName+".key")
				writeFile(t, cf, certPEM, 0o644)
				writeFile(t, kf, keyPEM, 0o600)
				purpose, wrong := "sslserver", "sslclient"
				if req.Client {
					purpose, wrong = wrong, purpose
				}
				opensslVerify(t, caFile, cf, purpose)
				if out, err := opensslErr(t, "verify", "-CAfile", caFile, "-purpose", wrong, cf); err == nil && strings.Contains(out, ": OK") {
					t.Fatalf("%s verified for purpose %s too: %s", req.CommonName, wrong, out)
				}
				if got, want := opensslSANs(t, cf), wantSANs(req.DNSNames, req.IPAddresses); !slices.Equal(got, want) {
					t.Fatalf("%s SANs per openssl %v, want %v", req.CommonName, got, want)
				}
				opensslSameKey(t, cf, kf)
				subj := openssl(t, "x509", "-noout", "-subject", "-in", cf)
				mustContain(t, subj, "CN = "+req.CommonName)
			}
		})
	}
}

func typeName(v any) string {
	switch v.(type) {
	case *rsa.PrivateKey:
		return "rsa"
	case *ecdsa.PrivateKey:
		return "ecdsa"
	case ed25519.PrivateKey:
		return "ed25519"
	}
	return "other"
}

func TestNewCAVerifiesWithOpenSSL(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t, "throwaway")
	caFile, _ := writeCA(t, dir, ca)
	if err := checkCA(ca.Cert, time.Now()); err != nil {
		t.Fatal(err)
	}
	// openssl must accept it as a trust anchor (self-signed, CA:TRUE).
	opensslVerify(t, caFile, caFile, "sslserver")
	if _, err := NewCA("", time.Hour); err == nil {
		t.Fatal("NewCA accepted an empty CN")
	}
	if _, err := NewCA("x", 0); err == nil {
		t.Fatal("NewCA accepted zero validity")
	}
}

func TestLoadCABundlePicksMatchingCert(t *testing.T) {
	dir := t.TempDir()
	other := newCA(t, "other")
	real := newCA(t, "real")
	_, keyFile := writeCA(t, dir, real)
	leafPEM, _, err := other.Issue(Request{CommonName: "leaf", DNSNames: []string{"x.example"}})
	if err != nil {
		t.Fatal(err)
	}
	bundle := filepath.Join(dir, "bundle.crt")
	writeFile(t, bundle, slices.Concat(other.CertPEM, leafPEM, real.CertPEM), 0o644)
	ca, err := LoadCA(bundle, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	if !ca.Cert.Equal(real.Cert) {
		t.Fatalf("picked %q, want real", ca.Cert.Subject.CommonName)
	}
	if string(ca.CertPEM) != string(real.CertPEM) {
		t.Fatal("CertPEM is not the chosen certificate alone")
	}
}

func TestLoadCAErrors(t *testing.T) {
	dir := t.TempDir()
	goodKey := opensslKey(t, dir, "ec-sec1")
	goodCA := opensslCert(t, dir, goodKey, "good-ca", "ca")
	otherKey := opensslKey(t, dir, "ec-pkcs8")
	notCA := opensslCert(t, dir, goodKey, "not-a-ca", "notca")
	noCertSign := opensslCert(t, dir, goodKey, "no-certsign", "nocertsign")

	now := time.Now()
	expired := caWithDates(t, "expired-ca", now.Add(-48*time.Hour), now.Add(-time.Hour))
	expDir := filepath.Join(dir, "expired")
	if err := os.Mkdir(expDir, 0o755); err != nil {
		t.Fatal(err)
	}
	expCert, expKey := writeCA(t, expDir, expired)
	future := caWithDates(t, "future-ca", now.Add(time.Hour), now.Add(48*time.Hour))
	futDir := filepath.Join(dir, "future")
	if err := os.Mkdir(futDir, 0o755); err != nil {
		t.Fatal(err)
	}
	futCert, futKey := writeCA(t, futDir, future)

	garbage := filepath.Join(dir, "garbage.pem")
	writeFile(t, garbage, []byte("not pem at all\n"), 0o644)
	badDER := filepath.Join(dir, "baddér.pem")
	writeFile(t, badDER, []byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"), 0o644)
	encKey := filepath.Join(dir, "enc.key")
	openssl(t, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-aes256", "-pass", "pass:secret", "-out", encKey)
	encTradKey := filepath.Join(dir, "enc-trad.key")
	openssl(t, "ec", "-in", encKey, "-passin", "pass:secret", "-aes256", "-passout", "pass:secret", "-out", encTradKey)
	x25519Key := filepath.Join(dir, "x25519.key")
	openssl(t, "genpkey", "-algorithm", "x25519", "-out", x25519Key)

	cases := []struct {
		name, cert, key, want string
	}{
		{"missing cert", filepath.Join(dir, "nope.crt"), goodKey, "read CA certificate"},
		{"missing key", goodCA, filepath.Join(dir, "nope.key"), "read CA key"},
		{"cert is a directory", dir, goodKey, "read CA certificate"},
		{"cert not PEM", garbage, goodKey, "no CERTIFICATE PEM block"},
		{"cert bad DER", badDER, goodKey, "certificate 1"},
		{"key not PEM", goodCA, garbage, "no private key PEM block"},
		{"key is a certificate", goodCA, goodCA, "no private key PEM block"},
		{"encrypted PKCS#8 key", goodCA, encKey, "encrypted private keys are not supported"},
		{"encrypted SEC1 key", goodCA, encTradKey, "encrypted private keys are not supported"},
		{"x25519 key", goodCA, x25519Key, "unsupported private key type"},
		{"key mismatch", goodCA, otherKey, "does not match any of the 1 certificate(s)"},
		{"not a CA", notCA, goodKey, "is not a CA (basicConstraints"},
		{"no keyCertSign", noCertSign, goodKey, "keyUsage lacks keyCertSign"},
		{"expired CA", expCert, expKey, "expired at"},
		{"not yet valid CA", futCert, futKey, "is not valid before"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := LoadCA(c.cert, c.key)
			if err == nil {
				t.Fatalf("LoadCA(%s, %s) succeeded", c.cert, c.key)
			}
			mustContain(t, err.Error(), c.want)
		})
	}
}

func TestParseSANs(t *testing.T) {
	good := []struct {
		in       string
		dns, ips []string
	}{
		{"", nil, nil},
		{"   ", nil, nil},
		{"a.example", []string{"a.example"}, nil},
		{" A.Example , 10.0.0.1,::1, *.svc.cluster.local,localhost", []string{"a.example", "*.svc.cluster.local", "localhost"}, []string{"10.0.0.1", "::1"}},
		{"x.example,X.example,10.0.0.1,10.0.0.1", []string{"x.example"}, []string{"10.0.0.1"}},
		{"konnectivity-server.kube-system.svc", []string{"konnectivity-server.kube-system.svc"}, nil},
		{"fe80::1,2001:db8::5", nil, []string{"fe80::1", "2001:db8::5"}},
	}
	for _, g := range good {
		dns, ips, err := ParseSANs(g.in)
		if err != nil {
			t.Fatalf("ParseSANs(%q): %v", g.in, err)
		}
		var gotIPs []string
		for _, ip := range ips {
			gotIPs = append(gotIPs, ip.String())
		}
		if !slices.Equal(dns, g.dns) || !slices.Equal(gotIPs, g.ips) {
			t.Fatalf("ParseSANs(%q) = %v %v, want %v %v", g.in, dns, gotIPs, g.dns, g.ips)
		}
	}
	bad := map[string]string{
		"a.example,":                         "entry 2 is empty",
		",a.example":                         "entry 1 is empty",
		"a.example,,b":                       "entry 2 is empty",
		"a.example, ,b":                      "entry 2 is empty",
		"foo bar":                            "not allowed",
		"-lead.example":                      "starts or ends",
		"a..example":                         "empty label",
		"10.0.0.300":                         "numeric top-level",
		"http://x.example":                   "not allowed",
		"x.example:443":                      "not allowed",
		"[::1]":                              "not allowed",
		"under_score.local":                  "not allowed",
		"*.":                                 "empty",
		strings.Repeat("a", 64) + ".example": "longer than 63",
	}
	for in, want := range bad {
		if _, _, err := ParseSANs(in); err == nil {
			t.Fatalf("ParseSANs(%q) succeeded", in)
		} else {
			mustContain(t, err.Error(), want)
		}
	}
}

func TestIssueRejectsBadRequests(t *testing.T) {
	ca := newCA(t, "ca")
	cases := map[string]Request{
		"no CN":          {DNSNames: []string{"a.example"}},
		"server no SANs": {CommonName: "x"},
		"bad key type":   {CommonName: "x", DNSNames: []string{"a.example"}, KeyType: "dsa"},
		"negative":       {CommonName: "x", DNSNames: []string{"a.example"}, Validity: -time.Hour},
		"bad DNS":        {CommonName: "x", DNSNames: []string{"a b"}},
		"bad IP":         {CommonName: "x", IPAddresses: []net.IP{{1, 2, 3}}},
	}
	for name, req := range cases {
		if _, _, err := ca.Issue(req); err == nil {
			t.Errorf("%s: Issue succeeded", name)
		}
	}
	var nilCA *CA
	if _, _, err := nilCA.Issue(Request{CommonName: "x", Client: true}); err == nil {
		t.Error("nil CA issued a certificate")
	}
}

func TestIssueCapsAtCAExpiry(t *testing.T) {
	now := time.Now()
	ca := caWithDates(t, "short-ca", now.Add(-time.Hour), now.Add(10*24*time.Hour))
	certPEM, _, err := ca.Issue(Request{CommonName: "x", DNSNames: []string{"x.example"}})
	if err != nil {
		t.Fatal(err)
	}
	certs, err := parseCertsPEM(certPEM)
	if err != nil {
		t.Fatal(err)
	}
	if !certs[0].NotAfter.Equal(ca.Cert.NotAfter) {
		t.Fatalf("leaf NotAfter %v, CA NotAfter %v", certs[0].NotAfter, ca.Cert.NotAfter)
	}
}
