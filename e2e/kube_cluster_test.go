package e2e

// A real control plane for TestKubeAPIServer: kube-apiserver (built from
// k8s.io/kubernetes in the nested module e2e/kube) on a single-member etcd
// (e2e/kube/etcd), with a throwaway PKI, RBAC, ServiceAccount token signing
// and the egress selector file that images/ ships.

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

const (
	// kubeModuleDir is the nested module that pins k8s.io/kubernetes and
	// etcd; its dependencies never meet the e2e module's or the product's.
	kubeModuleDir = "kube"
	// shippedEgressConfig is the file kube-apiserver reads on a node image;
	// controlPlaneEgressConfig the one beside the server's static pod.
	shippedEgressConfig      = "../images/eks-node/etc/rancher/k3s/egress-selector-config.yaml"
	controlPlaneEgressConfig = "../images/control-plane/egress-selector-configuration.yaml"
	shippedSocket            = "/run/konnectivity/konnectivity-server.socket"
	// kubeBuildTimeout bounds a cold build of kube-apiserver on a loaded
	// 2-core machine.
	kubeBuildTimeout = 60 * time.Minute
	// apiserverStartTimeout bounds kube-apiserver's start to /readyz.
	apiserverStartTimeout = 3 * time.Minute
)

// buildKubeBinaries builds kube-apiserver and the etcd runner into a cache
// directory that outlives the run; the Go build cache makes a rebuild with
// unchanged sources a link at most.
func buildKubeBinaries(t *testing.T) (apiserver, etcd string) {
	t.Helper()
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	dir := filepath.Join(cache, "konnectivity-e2e-kube")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("cache dir: %v", err)
	}
	apiserver = filepath.Join(dir, "kube-apiserver")
	etcd = filepath.Join(dir, "etcd")
	build := func(out, pkg string) {
		ctx, cancel := context.WithTimeout(context.Background(), kubeBuildTimeout)
		defer cancel()
		start := time.Now()
		cmd := exec.CommandContext(ctx, "go", "build", "-o", out, pkg)
		cmd.Dir = kubeModuleDir
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build %s (in e2e/%s): %v\n%s", pkg, kubeModuleDir, err, b)
		}
		t.Logf("built %s in %v", pkg, time.Since(start).Round(100*time.Millisecond))
	}
	build(apiserver, "k8s.io/kubernetes/cmd/kube-apiserver")
	build(etcd, "./etcd")
	return apiserver, etcd
}

// kubePKI is the control plane's throwaway PKI: one CA signs every serving
// and client certificate, and a key pair signs ServiceAccount tokens.
type kubePKI struct {
	dir    string
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	caFile string
	pool   *x509.CertPool
	serial atomic.Int64
}

func newKubePKI(t *testing.T, dir string) *kubePKI {
	t.Helper()
	k := &kubePKI{dir: dir, caKey: newKey(t), caFile: filepath.Join(dir, "kube-ca.crt")}
	k.serial.Store(1)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kube-e2e-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.caKey.PublicKey, k.caKey)
	if err != nil {
		t.Fatalf("kube CA: %v", err)
	}
	if k.ca, err = x509.ParseCertificate(der); err != nil {
		t.Fatal(err)
	}
	writePEM(t, k.caFile, "CERTIFICATE", der)
	k.pool = x509.NewCertPool()
	k.pool.AddCert(k.ca)
	return k
}

// issue writes name.crt and name.key and returns their paths and the pair.
// Client certificates carry the user in CN and groups in O.
func (k *kubePKI) issue(t *testing.T, name string, client bool, cn string, orgs []string, dns []string, ips []net.IP) (string, string, tls.Certificate) {
	t.Helper()
	key := newKey(t)
	usage := x509.ExtKeyUsageServerAuth
	if client {
		usage = x509.ExtKeyUsageClientAuth
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(k.serial.Add(1)),
		Subject:      pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		DNSNames:     dns,
		IPAddresses:  ips,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, k.ca, &key.PublicKey, k.caKey)
	if err != nil {
		t.Fatalf("issue %s: %v", name, err)
	}
	certFile, keyFile := filepath.Join(k.dir, name+".crt"), filepath.Join(k.dir, name+".key")
	writePEM(t, certFile, "CERTIFICATE", der)
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, keyFile, "PRIVATE KEY", keyDER)
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile, pair
}

// serving returns a TLS config serving a certificate for dns/ips.
func (k *kubePKI) serving(t *testing.T, name string, dns []string, ips []net.IP) *tls.Config {
	t.Helper()
	_, _, pair := k.issue(t, name, false, name, nil, dns, ips)
	return &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
}

// caPEM is the CA certificate in PEM, for caBundle fields.
func (k *kubePKI) caPEM(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile(k.caFile)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// kubeCluster is one etcd and one kube-apiserver.
type kubeCluster struct {
	pki       *kubePKI
	dir       string
	url       string // https://127.0.0.1:port
	apiserver *proc
	etcd      *proc
	admin     *http.Client
	adminTLS  *tls.Config
	adminCert string // the admin's client certificate and key files
	adminKey  string
}

// startKubeCluster starts etcd and kube-apiserver. egressConfig is the
// --egress-selector-config-file; advertise is the address the apiserver
// advertises (it refuses to pick one itself without a default route);
// extra flags are appended to kube-apiserver's.
func startKubeCluster(t *testing.T, apiserverBin, etcdBin, egressConfig string, advertise net.IP, extra ...string) *kubeCluster {
	t.Helper()
	dir, err := os.MkdirTemp("", "kube-e2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	k := newKubePKI(t, dir)
	c := &kubeCluster{pki: k, dir: dir}

	etcdPort, peerPort := freePort(t), freePort(t)
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdPort)
	c.etcd = startKubeProc(t, etcdBin, "etcd",
		"--data-dir="+filepath.Join(dir, "etcd"),
		"--listen-client-url="+etcdURL,
		"--listen-peer-url=http://127.0.0.1:"+strconv.Itoa(peerPort))
	waitFor(t, time.Minute, "etcd ready", func() bool {
		if c.etcd.exited() {
			t.Fatalf("etcd exited: %v\n%s", c.etcd.waitErr, c.etcd.out.String())
		}
		return strings.Contains(c.etcd.out.String(), "etcd ready")
	})

	port := freePort(t)
	c.url = "https://127.0.0.1:" + strconv.Itoa(port)
	servingCert, servingKey, _ := k.issue(t, "apiserver", false, "kube-apiserver", nil,
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		[]net.IP{net.IPv4(127, 0, 0, 1), advertise, net.IPv4(10, 96, 0, 1)})
	kubeletCert, kubeletKey, _ := k.issue(t, "apiserver-kubelet-client", true, "kube-apiserver-kubelet-client", nil, nil, nil)
	var adminPair tls.Certificate
	c.adminCert, c.adminKey, adminPair = k.issue(t, "admin", true, "e2e-admin", []string{"system:masters"}, nil, nil)
	saKey := newKey(t)
	saKeyDER, err := x509.MarshalPKCS8PrivateKey(saKey)
	if err != nil {
		t.Fatal(err)
	}
	saPubDER, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	saKeyFile, saPubFile := filepath.Join(dir, "sa.key"), filepath.Join(dir, "sa.pub")
	writePEM(t, saKeyFile, "PRIVATE KEY", saKeyDER)
	writePEM(t, saPubFile, "PUBLIC KEY", saPubDER)

	c.apiserver = startKubeProc(t, apiserverBin, "kube-apiserver", append([]string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--advertise-address=" + advertise.String(),
		"--cert-dir=" + filepath.Join(dir, "apiserver-certs"),
		"--tls-cert-file=" + servingCert,
		"--tls-private-key-file=" + servingKey,
		"--client-ca-file=" + k.caFile,
		"--authorization-mode=Node,RBAC",
		"--service-cluster-ip-range=10.96.0.0/24",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + saPubFile,
		"--service-account-signing-key-file=" + saKeyFile,
		"--egress-selector-config-file=" + egressConfig,
		"--enable-aggregator-routing=true",
		"--kubelet-client-certificate=" + kubeletCert,
		"--kubelet-client-key=" + kubeletKey,
		"--kubelet-certificate-authority=" + k.caFile,
		"--kubelet-preferred-address-types=InternalIP",
		"--profiling=false",
		"--v=1",
	}, extra...)...)

	c.adminTLS = &tls.Config{
		RootCAs:      k.pool,
		Certificates: []tls.Certificate{adminPair},
		NextProtos:   []string{"http/1.1"},
		MinVersion:   tls.VersionTLS12,
	}
	c.admin = &http.Client{
		Transport: &http.Transport{TLSClientConfig: c.adminTLS, ForceAttemptHTTP2: false},
		Timeout:   30 * time.Second,
	}
	start := time.Now()
	var last string
	for {
		if c.apiserver.exited() {
			t.Fatalf("kube-apiserver exited: %v\n%s", c.apiserver.waitErr, tail(c.apiserver.out.String(), 8000))
		}
		code, body, err := c.do(http.MethodGet, "/readyz", nil)
		if err == nil && code == http.StatusOK {
			break
		}
		last = fmt.Sprintf("%d %s %v", code, tail(string(body), 400), err)
		if time.Since(start) > apiserverStartTimeout {
			t.Fatalf("kube-apiserver not ready after %v: %s\n%s", apiserverStartTimeout, last, tail(c.apiserver.out.String(), 8000))
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("kube-apiserver ready in %v", time.Since(start).Round(100*time.Millisecond))
	return c
}

// startKubeProc starts a control-plane process that dies with the test
// process (SIGKILL on the parent's death), so no kill path leaves it
// behind.
func startKubeProc(t *testing.T, bin, name string, args ...string) *proc {
	t.Helper()
	p := newProc(bin, name, args...)
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p.start(t, func() {
		if t.Failed() {
			t.Logf("--- %s (last lines)\n%s--- end %s (%v)", name, tail(p.out.String(), 12000), name, p.waitErr)
		}
	})
	return p
}

// tail is the end of s, at most n bytes.
func tail(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return "…" + s[len(s)-n:]
}

// do sends a request as the admin; body is JSON-encoded unless it is
// already []byte.
func (c *kubeCluster) do(method, path string, body any) (int, []byte, error) {
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case []byte:
		r = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			return 0, nil, err
		}
		r = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, c.url+path, r)
	if err != nil {
		return 0, nil, err
	}
	if r != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	resp, err := c.admin.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	return resp.StatusCode, b, err
}

// mustDo is do that fails the test unless the status is want.
func (c *kubeCluster) mustDo(t *testing.T, want int, method, path string, body any) []byte {
	t.Helper()
	code, b, err := c.do(method, path, body)
	if err != nil || code != want {
		t.Fatalf("%s %s: status %d (want %d), err %v: %s", method, path, code, want, err, tail(string(b), 2000))
	}
	return b
}

// create POSTs obj to path and expects 201.
func (c *kubeCluster) create(t *testing.T, path string, obj any) []byte {
	t.Helper()
	return c.mustDo(t, http.StatusCreated, http.MethodPost, path, obj)
}

// writeKubeconfig writes a kubeconfig for the apiserver with the given
// client certificate identity.
func (c *kubeCluster) writeKubeconfig(t *testing.T, path, certFile, keyFile string) {
	t.Helper()
	writeKubeconfigFile(t, path, c.url, c.pki.caFile, fmt.Sprintf("{client-certificate: %q, client-key: %q}", certFile, keyFile))
}

// egressConfigFor copies a shipped egress selector file with only the
// socket path changed (and, for --mode=grpc, the matching proxyProtocol),
// failing if the shipped file no longer has what is replaced: the node
// image's for http-connect, the control-plane node's for grpc, so
// kube-apiserver reads each.
func egressConfigFor(t *testing.T, dir, sock, mode string) string {
	t.Helper()
	shipped := shippedEgressConfig
	if mode == "grpc" {
		shipped = controlPlaneEgressConfig
	}
	b, err := os.ReadFile(shipped)
	if err != nil {
		t.Fatalf("shipped egress config: %v", err)
	}
	s := string(b)
	if strings.Count(s, shippedSocket) != 1 || strings.Count(s, "proxyProtocol: HTTPConnect") != 1 {
		t.Fatalf("%s: want exactly one %s and one proxyProtocol: HTTPConnect (the cluster selection):\n%s", shipped, shippedSocket, s)
	}
	s = strings.Replace(s, shippedSocket, sock, 1)
	if mode == "grpc" {
		s = strings.Replace(s, "proxyProtocol: HTTPConnect", "proxyProtocol: GRPC", 1)
	}
	path := filepath.Join(dir, "egress-selector-config.yaml")
	if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
