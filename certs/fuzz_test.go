package certs

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"strings"
	"testing"
)

func FuzzParsePrivateKey(f *testing.F) {
	pemOf := func(typ string, der []byte) []byte {
		return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
	}
	rsaKey, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		f.Fatal(err)
	}
	ecKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	_, edKey, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	sec1, err := x509.MarshalECPrivateKey(ecKey)
	if err != nil {
		f.Fatal(err)
	}
	pkcs1 := x509.MarshalPKCS1PrivateKey(rsaKey)
	f.Add(pemOf("RSA PRIVATE KEY", pkcs1))
	f.Add(pemOf("EC PRIVATE KEY", sec1))
	f.Add(append(pemOf("EC PARAMETERS", []byte{0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07}), pemOf("EC PRIVATE KEY", sec1)...))
	for _, k := range []any{rsaKey, ecKey, edKey} {
		der, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(pemOf("PRIVATE KEY", der))
		f.Add(pemOf("RSA PRIVATE KEY", der)) // mislabelled
		f.Add(pemOf("PRIVATE KEY", der[:len(der)/2]))
	}
	f.Add(pemOf("EC PRIVATE KEY", sec1[:10]))
	f.Add([]byte("-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED PRIVATE KEY-----\n"))
	f.Add([]byte("-----BEGIN EC PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-256-CBC,00\n\nAAAA\n-----END EC PRIVATE KEY-----\n"))
	f.Add([]byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"))
	f.Add([]byte(""))
	f.Add([]byte("garbage"))

	f.Fuzz(func(t *testing.T, data []byte) {
		k, err := parsePrivateKeyPEM(data)
		if err != nil {
			if k != nil {
				t.Fatal("key returned with an error")
			}
			return
		}
		if k.Public() == nil {
			t.Fatal("parsed key has no public key")
		}
		// Whatever parses must survive the PKCS#8 round trip Issue uses.
		der, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			t.Fatalf("marshal parsed %T: %v", k, err)
		}
		k2, err := parsePrivateKeyPEM(pemOf("PRIVATE KEY", der))
		if err != nil {
			t.Fatalf("re-parse: %v", err)
		}
		if !publicKeysEqual(k.Public(), k2.Public()) {
			t.Fatal("round trip changed the key")
		}
	})
}

func FuzzParseSANs(f *testing.F) {
	for _, s := range []string{"", "a.example", "a.example,10.0.0.1,::1", "*.svc,LOCALHOST", "a,,b", "1.2.3.300", "x:443", " a , b ", "-a", strings.Repeat("a.", 130)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, list string) {
		dns, ips, err := ParseSANs(list)
		if err != nil {
			return
		}
		// Parsing is idempotent: re-joining the result parses to itself.
		var parts []string
		parts = append(parts, dns...)
		for _, ip := range ips {
			parts = append(parts, ip.String())
		}
		dns2, ips2, err := ParseSANs(strings.Join(parts, ","))
		if err != nil {
			t.Fatalf("re-parse of %q: %v", parts, err)
		}
		if len(dns2) != len(dns) || len(ips2) != len(ips) {
			t.Fatalf("re-parse of %q changed the result", parts)
		}
		for i := range dns {
			if dns[i] != dns2[i] {
				t.Fatalf("DNS %q became %q", dns[i], dns2[i])
			}
		}
		if len(dns)+len(ips) > 0 {
			req := Request{CommonName: "x", DNSNames: dns, IPAddresses: ips}
			if err := req.validate(); err != nil {
				t.Fatalf("ParseSANs output rejected by Request: %v", err)
			}
		}
	})
}
