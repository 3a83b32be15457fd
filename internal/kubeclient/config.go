package kubeclient

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"
)

const (
	// Bounds on what we read: a kubeconfig or credential file bigger than
	// this is a mistake, and reading it whole could exhaust memory.
	maxKubeconfigSize     = 4 << 20
	maxCredentialFileSize = 1 << 20

	// serviceAccountDir is where the kubelet mounts the pod's ServiceAccount.
	serviceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"
)

// Config is what is needed to call the kube-apiserver: its URL, how to
// verify it and how to authenticate to it. Build one with LoadKubeconfig or
// InClusterConfig.
type Config struct {
	server        string // base URL, no trailing slash
	tlsServerName string
	insecure      bool
	rootCAs       *x509.CertPool // nil: system roots
	clientCert    *tls.Certificate
	token         string
	tokenFile     string // re-read for every request (projected tokens rotate)
	proxy         *url.URL
	readFile      func(path string, limit int64) ([]byte, error)
}

// Server returns the apiserver base URL, e.g. "https://10.0.0.1:6443".
func (c *Config) Server() string { return c.server }

// String describes the config without any secret.
func (c *Config) String() string {
	authn := "none"
	switch {
	case c.clientCert != nil && (c.token != "" || c.tokenFile != ""):
		authn = "client-certificate+token"
	case c.clientCert != nil:
		authn = "client-certificate"
	case c.tokenFile != "":
		authn = "tokenFile " + c.tokenFile
	case c.token != "":
		authn = "token"
	}
	return fmt.Sprintf("Config{server=%s auth=%s insecure=%t}", c.server, authn, c.insecure)
}

// GoString keeps %#v from printing the token.
func (c *Config) GoString() string { return c.String() }

// httpClient returns a client that talks to Server() with the configured
// TLS settings and credentials. It has no overall timeout; bound requests
// with their context.
func (c *Config) httpClient() *http.Client {
	tlsCfg := &tls.Config{
		MinVersion:         tls.VersionTLS12,
		RootCAs:            c.rootCAs,
		ServerName:         c.tlsServerName,
		InsecureSkipVerify: c.insecure, // only when the kubeconfig asks for it
	}
	if c.clientCert != nil {
		tlsCfg.Certificates = []tls.Certificate{*c.clientCert}
	}
	proxy := http.ProxyFromEnvironment
	if c.proxy != nil {
		proxy = http.ProxyURL(c.proxy)
	}
	tr := &http.Transport{
		Proxy:               proxy,
		DialContext:         (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:     tlsCfg,
		TLSHandshakeTimeout: 10 * time.Second,
		ForceAttemptHTTP2:   true, // a custom TLS config disables HTTP/2 otherwise
		MaxIdleConnsPerHost: 4,
		IdleConnTimeout:     90 * time.Second,
	}
	var rt http.RoundTripper = tr
	if c.token != "" || c.tokenFile != "" {
		rt = &bearerTransport{cfg: c, next: tr}
	}
	return &http.Client{Transport: rt}
}

// bearerTransport adds the Authorization header, reading tokenFile anew for
// each request so a rotated projected token is picked up.
type bearerTransport struct {
	cfg  *Config
	next http.RoundTripper
}

func (b *bearerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Header.Get("Authorization") != "" {
		return b.next.RoundTrip(req)
	}
	token := b.cfg.token
	if b.cfg.tokenFile != "" {
		data, err := b.cfg.readFile(b.cfg.tokenFile, maxCredentialFileSize)
		if err != nil {
			if req.Body != nil {
				req.Body.Close() // RoundTrip must close the body, even on error
			}
			return nil, fmt.Errorf("read tokenFile: %w", err)
		}
		token = strings.TrimSpace(string(data))
	}
	req = req.Clone(req.Context())
	req.Header.Set("Authorization", "Bearer "+token)
	return b.next.RoundTrip(req)
}

// readRegularFile reads at most limit bytes of a regular file. Refusing
// devices and FIFOs keeps a typo like /dev/zero from hanging or eating memory.
func readRegularFile(path string, limit int64) ([]byte, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file", path)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, limit)
	}
	return data, nil
}

// InClusterConfig returns the config a pod uses to reach its apiserver:
// KUBERNETES_SERVICE_HOST/PORT, the ServiceAccount token (re-read per
// request, as the kubelet rotates it) and the cluster CA.
func InClusterConfig() (*Config, error) {
	return inClusterConfig(serviceAccountDir, os.Getenv)
}

func inClusterConfig(dir string, getenv func(string) string) (*Config, error) {
	host, port := getenv("KUBERNETES_SERVICE_HOST"), getenv("KUBERNETES_SERVICE_PORT")
	if host == "" || port == "" {
		return nil, errors.New("in-cluster config: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must be set (not running in a pod? pass --kubeconfig)")
	}
	cfg := &Config{
		server:    "https://" + net.JoinHostPort(host, port),
		tokenFile: filepath.Join(dir, "token"),
		readFile:  readRegularFile,
	}
	if err := checkTokenFile(cfg.tokenFile, readRegularFile); err != nil {
		return nil, fmt.Errorf("in-cluster config: %w", err)
	}
	caPEM, err := readRegularFile(filepath.Join(dir, "ca.crt"), maxCredentialFileSize)
	if err != nil {
		return nil, fmt.Errorf("in-cluster config: read CA: %w", err)
	}
	if cfg.rootCAs, err = certPool(caPEM); err != nil {
		return nil, fmt.Errorf("in-cluster config: %s: %w", filepath.Join(dir, "ca.crt"), err)
	}
	return cfg, nil
}

func checkTokenFile(path string, readFile func(string, int64) ([]byte, error)) error {
	data, err := readFile(path, maxCredentialFileSize)
	if err != nil {
		return fmt.Errorf("read token: %w", err)
	}
	if strings.TrimSpace(string(data)) == "" {
		return fmt.Errorf("token file %s is empty", path)
	}
	return nil
}

func certPool(pemData []byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemData) {
		return nil, errors.New("no PEM certificates found")
	}
	return pool, nil
}
