package main

import (
	"fmt"
	"io"
	"path/filepath"
	"time"

	"github.com/spinifex/konnectivity/certs"
)

// runCert implements "konnectivity cert" (also invoked as
// eks-konnectivity-cert): make sure a certificate/key pair signed by a given
// CA exists with the requested names, minting it only when needed. It prints
// one line, "minted PATH: REASON" or "reused PATH: REASON", so init scripts
// can run it on every start.
func runCert(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("konnectivity cert")
	dir := fs.String("dir", "", "output directory for tls.crt and tls.key (created if missing)")
	caCert := fs.String("ca-cert", "", "CA certificate, PEM (a bundle is searched for the certificate matching -ca-key)")
	caKey := fs.String("ca-key", "", "CA private key, PEM (PKCS#1 RSA, SEC1 EC or PKCS#8)")
	cn := fs.String("cn", "konnectivity-server", "certificate common name")
	sans := fs.String("sans", "", "comma-separated DNS names and IP addresses (required for serving certificates)")
	days := fs.Int("days", 365, "validity in days (capped at the CA's expiry)")
	renewBefore := fs.Duration("renew-before", 720*time.Hour, "mint anew when the current certificate expires within this (0 means 720h)")
	client := fs.Bool("client", false, "mint a client certificate (agent mTLS) instead of a serving certificate")
	outCert := fs.String("out-cert", "", "certificate path (default DIR/tls.crt)")
	outKey := fs.String("out-key", "", "private key path, written mode 0600 (default DIR/tls.key)")
	keyType := fs.String("key-type", certs.KeyECDSAP256, "key type: ecdsa-p256, rsa-2048 or ed25519")
	usage := "Usage: konnectivity cert -ca-cert FILE -ca-key FILE (-dir DIR | -out-cert FILE -out-key FILE) [flags]\n\n" +
		"Reuses the existing pair when it is still valid for the request, otherwise mints a new one.\n"
	if code, done := flagsParsed(fs, fs.Parse(args), usage, stdout, stderr); done {
		return code
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "konnectivity cert: "+format+"\n", a...)
		return 1
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "konnectivity cert: unexpected arguments: %q\n", fs.Args())
		return 2
	}
	if *caCert == "" || *caKey == "" {
		return fail("-ca-cert and -ca-key are required")
	}
	if *outCert == "" || *outKey == "" {
		if *dir == "" {
			return fail("give -dir, or both -out-cert and -out-key")
		}
		if *outCert == "" {
			*outCert = filepath.Join(*dir, "tls.crt")
		}
		if *outKey == "" {
			*outKey = filepath.Join(*dir, "tls.key")
		}
	}
	if *days <= 0 {
		return fail("-days must be positive, got %d", *days)
	}
	dnsNames, ips, err := certs.ParseSANs(*sans)
	if err != nil {
		return fail("-sans: %v", err)
	}
	ca, err := certs.LoadCA(*caCert, *caKey)
	if err != nil {
		return fail("%v", err)
	}
	res, err := certs.Ensure(certs.EnsureOptions{
		CertFile: *outCert,
		KeyFile:  *outKey,
		CA:       ca,
		Request: certs.Request{
			CommonName:  *cn,
			DNSNames:    dnsNames,
			IPAddresses: ips,
			Client:      *client,
			Validity:    time.Duration(*days) * 24 * time.Hour,
			KeyType:     *keyType,
		},
		RenewBefore: *renewBefore,
	})
	if err != nil {
		return fail("%v", err)
	}
	verb := "reused"
	if res.Minted {
		verb = "minted"
	}
	fmt.Fprintf(stdout, "%s %s: %s\n", verb, *outCert, res.Reason)
	return 0
}
