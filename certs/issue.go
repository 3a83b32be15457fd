package certs

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"
)

// Key types accepted in Request.KeyType.
const (
	KeyECDSAP256 = "ecdsa-p256"
	KeyRSA2048   = "rsa-2048"
	KeyEd25519   = "ed25519"
)

// DefaultValidity is used when Request.Validity is zero.
const DefaultValidity = 365 * 24 * time.Hour

// Request describes a leaf certificate to mint.
type Request struct {
	CommonName  string
	DNSNames    []string
	IPAddresses []net.IP
	// Client selects a client certificate (ExtKeyUsageClientAuth); otherwise
	// a serving certificate (ExtKeyUsageServerAuth), which needs a SAN
	// because Go clients ignore the CN when verifying host names.
	Client   bool
	Validity time.Duration // zero means DefaultValidity; capped at the CA's expiry
	KeyType  string        // KeyECDSAP256 (default when empty), KeyRSA2048 or KeyEd25519
}

func (r Request) keyType() string {
	if r.KeyType == "" {
		return KeyECDSAP256
	}
	return r.KeyType
}

func (r Request) validity() time.Duration {
	if r.Validity == 0 {
		return DefaultValidity
	}
	return r.Validity
}

func (r Request) usage() string {
	if r.Client {
		return "client"
	}
	return "server"
}

func (r Request) validate() error {
	if r.CommonName == "" {
		return errors.New("common name is empty")
	}
	switch r.keyType() {
	case KeyECDSAP256, KeyRSA2048, KeyEd25519:
	default:
		return fmt.Errorf("unknown key type %q (want %s, %s or %s)", r.KeyType, KeyECDSAP256, KeyRSA2048, KeyEd25519)
	}
	if r.Validity < 0 {
		return fmt.Errorf("validity %v is negative", r.Validity)
	}
	if !r.Client && len(r.DNSNames) == 0 && len(r.IPAddresses) == 0 {
		return errors.New("a serving certificate needs at least one DNS or IP SAN (clients verify SANs, not the CN)")
	}
	for _, d := range r.DNSNames {
		if err := checkDNSName(d); err != nil {
			return err
		}
	}
	for _, ip := range r.IPAddresses {
		if len(ip) != net.IPv4len && len(ip) != net.IPv6len {
			return fmt.Errorf("invalid IP address SAN %v", ip)
		}
	}
	return nil
}

// Issue mints a key and a certificate for req signed by ca. The key is
// returned as PKCS#8 PEM ("PRIVATE KEY").
func (ca *CA) Issue(req Request) (certPEM, keyPEM []byte, err error) {
	c, k, _, err := ca.issueAt(req, time.Now())
	return c, k, err
}

// issueAt mints as of now and also returns the parsed certificate.
func (ca *CA) issueAt(req Request, now time.Time) (certPEM, keyPEM []byte, cert *x509.Certificate, err error) {
	if ca == nil || ca.Cert == nil || ca.Key == nil {
		return nil, nil, nil, errors.New("issue certificate: no CA")
	}
	if err := req.validate(); err != nil {
		return nil, nil, nil, fmt.Errorf("issue certificate: %w", err)
	}
	key, err := generateKey(req.keyType())
	if err != nil {
		return nil, nil, nil, fmt.Errorf("issue certificate: generate %s key: %w", req.keyType(), err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, nil, nil, fmt.Errorf("issue certificate: %w", err)
	}
	notAfter := now.Add(req.validity())
	if notAfter.After(ca.Cert.NotAfter) {
		// A leaf outliving its CA would fail verification anyway.
		notAfter = ca.Cert.NotAfter
	}
	usage := x509.KeyUsageDigitalSignature
	if _, ok := key.(*rsa.PrivateKey); ok {
		// RSA key exchange in TLS 1.2 encrypts to the certificate key.
		usage |= x509.KeyUsageKeyEncipherment
	}
	ext := x509.ExtKeyUsageServerAuth
	if req.Client {
		ext = x509.ExtKeyUsageClientAuth
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: req.CommonName},
		DNSNames:              normalizeDNS(req.DNSNames),
		IPAddresses:           normalizeIPs(req.IPAddresses),
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              notAfter,
		KeyUsage:              usage,
		ExtKeyUsage:           []x509.ExtKeyUsage{ext},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.Key)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("issue certificate: sign: %w", err)
	}
	cert, err = x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("issue certificate: parse result: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("issue certificate: marshal key: %w", err)
	}
	keyPEM = pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	return encodeCertPEM(der), keyPEM, cert, nil
}

func generateKey(keyType string) (crypto.Signer, error) {
	switch keyType {
	case KeyECDSAP256:
		return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	case KeyRSA2048:
		return rsa.GenerateKey(rand.Reader, 2048)
	case KeyEd25519:
		_, k, err := ed25519.GenerateKey(rand.Reader)
		return k, err
	}
	return nil, fmt.Errorf("unknown key type %q", keyType)
}

// keyTypeOf names pub in Request.KeyType terms.
func keyTypeOf(pub crypto.PublicKey) string {
	switch p := pub.(type) {
	case *ecdsa.PublicKey:
		if p.Curve == elliptic.P256() {
			return KeyECDSAP256
		}
		return "ecdsa-" + p.Curve.Params().Name
	case *rsa.PublicKey:
		return fmt.Sprintf("rsa-%d", p.N.BitLen())
	case ed25519.PublicKey:
		return KeyEd25519
	}
	return fmt.Sprintf("%T", pub)
}

// ParseSANs splits a comma-separated list of DNS names and IP addresses.
// Blank space around entries is ignored, duplicates are dropped and DNS names
// are lower-cased; an empty entry (",," or a trailing comma) or an entry that
// is neither an IP nor a valid DNS name is an error. An entirely blank list
// yields no SANs.
func ParseSANs(list string) (dns []string, ips []net.IP, err error) {
	if strings.TrimSpace(list) == "" {
		return nil, nil, nil
	}
	seen := map[string]bool{}
	for i, raw := range strings.Split(list, ",") {
		e := strings.TrimSpace(raw)
		if e == "" {
			return nil, nil, fmt.Errorf("SAN list %q: entry %d is empty", list, i+1)
		}
		if ip := net.ParseIP(e); ip != nil {
			key := "ip:" + ip.String()
			if !seen[key] {
				seen[key] = true
				ips = append(ips, ip)
			}
			continue
		}
		if err := checkDNSName(e); err != nil {
			return nil, nil, fmt.Errorf("SAN list %q: %w", list, err)
		}
		e = strings.ToLower(e)
		if !seen["dns:"+e] {
			seen["dns:"+e] = true
			dns = append(dns, e)
		}
	}
	return dns, normalizeIPs(ips), nil
}

// checkDNSName accepts host names (LDH labels) with an optional leading "*."
// wildcard label. A numeric last label is refused so that typos such as
// 10.0.0.300 are not taken for host names.
func checkDNSName(name string) error {
	bad := func(why string) error { return fmt.Errorf("invalid DNS name SAN %q: %s", name, why) }
	n := strings.TrimPrefix(name, "*.")
	if n == "" {
		return bad("empty")
	}
	if len(n) > 253 {
		return bad("longer than 253 characters")
	}
	labels := strings.Split(n, ".")
	for _, l := range labels {
		if l == "" {
			return bad("empty label")
		}
		if len(l) > 63 {
			return bad("label longer than 63 characters")
		}
		if l[0] == '-' || l[len(l)-1] == '-' {
			return bad("label starts or ends with '-'")
		}
		for i := 0; i < len(l); i++ {
			c := l[i]
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return bad(fmt.Sprintf("character %q not allowed", c))
			}
		}
	}
	last := labels[len(labels)-1]
	if strings.Trim(last, "0123456789") == "" {
		return bad("numeric top-level label (not a valid IP address either)")
	}
	return nil
}

func normalizeDNS(in []string) []string {
	if len(in) == 0 {
		return nil
	}
	out := make([]string, len(in))
	for i, d := range in {
		out[i] = strings.ToLower(d)
	}
	return out
}

// normalizeIPs stores IPv4 addresses in 4-byte form so they encode as IPv4.
func normalizeIPs(in []net.IP) []net.IP {
	if len(in) == 0 {
		return nil
	}
	out := make([]net.IP, len(in))
	for i, ip := range in {
		if v4 := ip.To4(); v4 != nil {
			ip = v4
		}
		out[i] = ip
	}
	return out
}
