package certs

import (
	"bytes"
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
	"math/big"
	"os"
	"time"
)

// CA is a certificate authority able to sign leaf certificates.
type CA struct {
	Cert    *x509.Certificate
	Key     crypto.Signer
	CertPEM []byte // PEM of Cert alone (what clients put in their trust bundle)
}

// clockSkew backdates NotBefore so hosts whose clocks lag slightly still
// accept a freshly minted certificate.
const clockSkew = 5 * time.Minute

// NewCA creates a self-signed ECDSA P-256 CA valid for validity from now.
// It is meant for tests and throwaway setups such as "konnectivity demo".
func NewCA(commonName string, validity time.Duration) (*CA, error) {
	if commonName == "" {
		return nil, errors.New("new CA: common name is empty")
	}
	if validity <= 0 {
		return nil, fmt.Errorf("new CA: validity %v must be positive", validity)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("new CA: generate key: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, fmt.Errorf("new CA: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: commonName},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              now.Add(validity),
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("new CA: sign: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("new CA: parse own certificate: %w", err)
	}
	return &CA{Cert: cert, Key: key, CertPEM: encodeCertPEM(der)}, nil
}

// LoadCA reads a CA certificate (a bundle may hold several; the one whose
// public key matches the key file is used) and its private key in PKCS#1,
// SEC1 or PKCS#8 PEM form. It fails when a file is unreadable, the key matches
// no certificate, the matching certificate is not a CA, or it is expired.
func LoadCA(certFile, keyFile string) (*CA, error) {
	certData, err := os.ReadFile(certFile)
	if err != nil {
		return nil, fmt.Errorf("read CA certificate: %w", err)
	}
	keyData, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, fmt.Errorf("read CA key: %w", err)
	}
	certs, err := parseCertsPEM(certData)
	if err != nil {
		return nil, fmt.Errorf("parse CA certificate %s: %w", certFile, err)
	}
	key, err := parsePrivateKeyPEM(keyData)
	if err != nil {
		return nil, fmt.Errorf("parse CA key %s: %w", keyFile, err)
	}
	var matching []*x509.Certificate
	for _, c := range certs {
		if publicKeysEqual(c.PublicKey, key.Public()) {
			matching = append(matching, c)
		}
	}
	if len(matching) == 0 {
		return nil, fmt.Errorf("CA key %s does not match any of the %d certificate(s) in %s", keyFile, len(certs), certFile)
	}
	// Several certificates for one key happen when a CA was re-issued; prefer
	// a usable one that lives longest.
	var best *x509.Certificate
	var firstErr error
	now := time.Now()
	for _, c := range matching {
		if err := checkCA(c, now); err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		if best == nil || c.NotAfter.After(best.NotAfter) {
			best = c
		}
	}
	if best == nil {
		return nil, fmt.Errorf("CA certificate %s: %w", certFile, firstErr)
	}
	return &CA{Cert: best, Key: key, CertPEM: encodeCertPEM(best.Raw)}, nil
}

// checkCA reports why c cannot sign leaf certificates at time now.
func checkCA(c *x509.Certificate, now time.Time) error {
	subject := c.Subject.String()
	if !c.BasicConstraintsValid || !c.IsCA {
		return fmt.Errorf("%q is not a CA (basicConstraints CA:TRUE missing)", subject)
	}
	// An absent keyUsage extension parses as 0 and permits every usage.
	if c.KeyUsage != 0 && c.KeyUsage&x509.KeyUsageCertSign == 0 {
		return fmt.Errorf("%q is not a CA (keyUsage lacks keyCertSign)", subject)
	}
	if now.After(c.NotAfter) {
		return fmt.Errorf("%q expired at %s", subject, c.NotAfter.UTC().Format(time.RFC3339))
	}
	if now.Before(c.NotBefore) {
		return fmt.Errorf("%q is not valid before %s", subject, c.NotBefore.UTC().Format(time.RFC3339))
	}
	return nil
}

// parseCertsPEM parses every CERTIFICATE block in data and requires at least
// one. Other block types are skipped so combined PEM files work.
func parseCertsPEM(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	rest := data
	for {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("certificate %d: %w", len(out)+1, err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("no CERTIFICATE PEM block found")
	}
	return out, nil
}

// parsePrivateKeyPEM returns the first private key in data. It accepts
// "RSA PRIVATE KEY" (PKCS#1), "EC PRIVATE KEY" (SEC1, optionally preceded by
// "EC PARAMETERS" as openssl ecparam writes) and "PRIVATE KEY" (PKCS#8), and
// falls back to the other encodings when a block is mislabelled.
func parsePrivateKeyPEM(data []byte) (crypto.Signer, error) {
	rest := data
	for {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return nil, errors.New("no private key PEM block found")
		}
		switch b.Type {
		case "ENCRYPTED PRIVATE KEY":
			return nil, errors.New("encrypted private keys are not supported (decrypt with: openssl pkey -in KEY -out PLAIN)")
		case "RSA PRIVATE KEY", "EC PRIVATE KEY", "PRIVATE KEY":
			if _, ok := b.Headers["DEK-Info"]; ok {
				return nil, errors.New("encrypted private keys are not supported (decrypt with: openssl pkey -in KEY -out PLAIN)")
			}
			return parsePrivateKeyDER(b.Type, b.Bytes)
		}
	}
}

func parsePrivateKeyDER(pemType string, der []byte) (crypto.Signer, error) {
	parsers := map[string]func([]byte) (any, error){
		"PRIVATE KEY":     x509.ParsePKCS8PrivateKey,
		"RSA PRIVATE KEY": func(d []byte) (any, error) { return x509.ParsePKCS1PrivateKey(d) },
		"EC PRIVATE KEY":  func(d []byte) (any, error) { return x509.ParseECPrivateKey(d) },
	}
	order := []string{pemType}
	for _, t := range []string{"PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"} {
		if t != pemType {
			order = append(order, t)
		}
	}
	var firstErr error
	for _, t := range order {
		k, err := parsers[t](der)
		if err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		switch k := k.(type) {
		case *rsa.PrivateKey:
			return k, nil
		case *ecdsa.PrivateKey:
			return k, nil
		case ed25519.PrivateKey:
			return k, nil
		default:
			return nil, fmt.Errorf("unsupported private key type %T (want RSA, ECDSA or Ed25519)", k)
		}
	}
	return nil, fmt.Errorf("parse %s: %w", pemType, firstErr)
}

// publicKeysEqual compares two public keys of any supported type.
func publicKeysEqual(a, b crypto.PublicKey) bool {
	ae, ok := a.(interface{ Equal(crypto.PublicKey) bool })
	return ok && ae.Equal(b)
}

func randomSerial() (*big.Int, error) {
	// 128 random bits, as recommended by the CA/B forum baseline (>= 64).
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, fmt.Errorf("generate serial number: %w", err)
	}
	return n.Add(n, big.NewInt(1)), nil
}

func encodeCertPEM(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// signedBy reports whether leaf names ca as issuer and carries its signature.
func signedBy(leaf, ca *x509.Certificate) bool {
	return bytes.Equal(leaf.RawIssuer, ca.RawSubject) && leaf.CheckSignatureFrom(ca) == nil
}
