package kubeclient

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spinifex/konnectivity/internal/kubeapi"
)

// probe calls f through a Client of cfg: nil when f took the call.
func probe(t *testing.T, f *fakeAPIServer, cfg *Config) error {
	t.Helper()
	_, err := New(cfg).Call(testCtx(t), http.MethodGet, "/api", nil, 1<<20)
	return err
}

func load(t *testing.T, dir, yaml, context string) *Config {
	t.Helper()
	path := filepath.Join(dir, "kubeconfig")
	writeFile(t, path, []byte(yaml))
	cfg, err := LoadKubeconfig(path, context)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func TestKubeconfigInlineData(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{requireClientCert: true})
	cfg := load(t, t.TempDir(), f.kubeconfigInline(), "")
	if cfg.Server() != f.url() {
		t.Errorf("server %q, want %q", cfg.Server(), f.url())
	}
	if err := probe(t, f, cfg); err != nil {
		t.Fatal(err)
	}
}

func TestKubeconfigFilePaths(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{requireClientCert: true})
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "pki", "ca.crt"), f.caPEM)
	writeFile(t, filepath.Join(dir, "pki", "client.crt"), f.certPEM)
	writeFile(t, filepath.Join(dir, "pki", "client.key"), f.keyPEM)
	const tmpl = `current-context: c
clusters:
- name: k
  cluster:
    server: %s
    certificate-authority: %s
contexts:
- name: c
  context:
    cluster: k
    user: u
users:
- name: u
  user:
    client-certificate: %s
    client-key: %s
`
	t.Run("absolute", func(t *testing.T) {
		p := func(s string) string { return filepath.Join(dir, "pki", s) }
		cfg := load(t, t.TempDir(), fmt.Sprintf(tmpl, f.url(), p("ca.crt"), p("client.crt"), p("client.key")), "")
		if err := probe(t, f, cfg); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("relative to the kubeconfig", func(t *testing.T) {
		cfg := load(t, dir, fmt.Sprintf(tmpl, f.url(), "pki/ca.crt", "./pki/client.crt", "pki/../pki/client.key"), "")
		if err := probe(t, f, cfg); err != nil {
			t.Fatal(err)
		}
		// Relative to the kubeconfig's folder, not the working directory.
		t.Chdir(t.TempDir())
		cfg, err := LoadKubeconfig(filepath.Join(dir, "kubeconfig"), "")
		if err != nil {
			t.Fatal(err)
		}
		if err := probe(t, f, cfg); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("relative kubeconfig path", func(t *testing.T) {
		t.Chdir(filepath.Dir(dir))
		cfg, err := LoadKubeconfig(filepath.Join(filepath.Base(dir), "kubeconfig"), "")
		if err != nil {
			t.Fatal(err)
		}
		if err := probe(t, f, cfg); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("data wins over file", func(t *testing.T) {
		y := strings.Replace(fmt.Sprintf(tmpl, f.url(), "missing-ca.crt", "pki/client.crt", "pki/client.key"),
			"certificate-authority: missing-ca.crt", "certificate-authority: missing-ca.crt\n    certificate-authority-data: "+b64(f.caPEM), 1)
		cfg := load(t, dir, y, "")
		if err := probe(t, f, cfg); err != nil {
			t.Fatal(err)
		}
	})
}

func TestKubeconfigToken(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{})
	f.wantBearer = "server-token-1"
	cfg := load(t, t.TempDir(), kubeconfigFor(f.url(), b64(f.caPEM), "    token: server-token-1\n"), "")
	if err := probe(t, f, cfg); err != nil {
		t.Fatal(err)
	}
	if s := fmt.Sprintf("%v %+v %#v %s", cfg, cfg, cfg, cfg); strings.Contains(s, "server-token-1") {
		t.Errorf("formatting the config shows the token: %s", s)
	}
	f.mu.Lock()
	f.wantBearer = "another"
	f.mu.Unlock()
	if err := probe(t, f, cfg); !kubeapi.IsCode(err, http.StatusUnauthorized) {
		t.Fatalf("wrong apiserver credentials: got %v, want 401", err)
	}
}

func TestKubeconfigTokenFileReread(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{})
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "secrets", "token"), []byte("rotating-1\n"))
	y := kubeconfigFor(f.url(), b64(f.caPEM), "    token: stale-inline\n    tokenFile: secrets/token\n")
	cfg := load(t, dir, y, "")
	f.wantBearer = "rotating-1"
	if err := probe(t, f, cfg); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "secrets", "token"), []byte("rotating-2"))
	f.mu.Lock()
	f.wantBearer = "rotating-2"
	f.mu.Unlock()
	if err := probe(t, f, cfg); err != nil {
		t.Fatalf("rotated token not picked up: %v", err)
	}
	os.Remove(filepath.Join(dir, "secrets", "token"))
	err := probe(t, f, cfg)
	if err == nil || !strings.Contains(err.Error(), "tokenFile") {
		t.Fatalf("missing token file: got %v, want an error naming tokenFile", err)
	}
}

func TestKubeconfigContextSelection(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{requireClientCert: true})
	y := f.kubeconfigInline() + `- name: nocert
  user: {token: x}
`
	y = strings.Replace(y, "contexts:\n", "contexts:\n- name: other\n  context: {cluster: fake, user: nocert}\n", 1)
	y = strings.Replace(y, "current-context: main", "current-context: other", 1)
	dir := t.TempDir()
	// current-context has no client certificate: the apiserver refuses it.
	if err := probe(t, f, load(t, dir, y, "")); err == nil {
		t.Fatalf("current-context: got %v, want a refusal (no client cert)", err)
	}
	if err := probe(t, f, load(t, dir, y, "main")); err != nil {
		t.Fatalf("--context main: %v", err)
	}
	if _, err := LoadKubeconfig(filepath.Join(dir, "kubeconfig"), "nope"); err == nil || !strings.Contains(err.Error(), `context "nope": not found`) {
		t.Fatalf("unknown context: %v", err)
	}
}

func TestKubeconfigInsecureSkipVerify(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{requireClientCert: true})
	y := strings.Replace(f.kubeconfigInline(), "certificate-authority-data: "+b64(f.caPEM), "insecure-skip-tls-verify: true", 1)
	if err := probe(t, f, load(t, t.TempDir(), y, "")); err != nil {
		t.Fatal(err)
	}
	// Without a CA and without the flag the system roots are used: refused.
	y = strings.Replace(y, "insecure-skip-tls-verify: true", "insecure-skip-tls-verify: false", 1)
	err := probe(t, f, load(t, t.TempDir(), y, ""))
	if err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("got %v, want a certificate error", err)
	}
}

func TestKubeconfigTLSServerName(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{requireClientCert: true, dnsOnly: true})
	y := f.kubeconfigInline()
	err := probe(t, f, load(t, t.TempDir(), y, ""))
	if err == nil || !strings.Contains(err.Error(), "127.0.0.1") {
		t.Fatalf("without tls-server-name: got %v, want a name mismatch", err)
	}
	y = strings.Replace(y, "    server: ", "    tls-server-name: kubernetes.test\n    server: ", 1)
	if err := probe(t, f, load(t, t.TempDir(), y, "")); err != nil {
		t.Fatalf("with tls-server-name: %v", err)
	}
}

func TestKubeconfigServerForms(t *testing.T) {
	for in, want := range map[string]string{
		"https://10.0.0.1:6443/":            "https://10.0.0.1:6443",
		"10.0.0.1:6443":                     "https://10.0.0.1:6443",
		"http://localhost:8080":             "http://localhost:8080",
		"https://rancher.example/k8s/c-1/":  "https://rancher.example/k8s/c-1",
		"https://[fd00::1]:6443":            "https://[fd00::1]:6443",
		"https://h.example:6443/a%2Fb/path": "https://h.example:6443/a%2Fb/path",
	} {
		cfg, err := ParseKubeconfig([]byte(fmt.Sprintf("current-context: c\ncontexts: [{name: c, context: {cluster: k}}]\nclusters: [{name: k, cluster: {server: %q}}]\n", in)), "", "")
		if err != nil {
			t.Errorf("%s: %v", in, err)
			continue
		}
		if cfg.Server() != want {
			t.Errorf("%s: got %s, want %s", in, cfg.Server(), want)
		}
	}
}

func TestLoadKubeconfigEmptyPathMeansInCluster(t *testing.T) {
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	_, err := LoadKubeconfig("", "")
	if err == nil || !strings.Contains(err.Error(), "in-cluster") {
		t.Fatalf("got %v, want an in-cluster config error", err)
	}
	if _, err := LoadKubeconfig("", "ctx"); err == nil {
		t.Fatal("context without kubeconfig accepted")
	}
}

func TestInClusterConfig(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{})
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "ca.crt"), f.caPEM)
	writeFile(t, filepath.Join(dir, "token"), []byte("pod-token-1"))
	host, port, _ := strings.Cut(strings.TrimPrefix(f.url(), "https://"), ":")
	env := map[string]string{"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
	cfg, err := inClusterConfig(dir, func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Server() != f.url() {
		t.Errorf("server %s, want %s", cfg.Server(), f.url())
	}
	f.wantBearer = "pod-token-1"
	if err := probe(t, f, cfg); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "token"), []byte("pod-token-2"))
	f.mu.Lock()
	f.wantBearer = "pod-token-2"
	f.mu.Unlock()
	if err := probe(t, f, cfg); err != nil {
		t.Fatalf("rotated pod token: %v", err)
	}

	env6 := map[string]string{"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
	cfg, err = inClusterConfig(dir, func(k string) string { return env6[k] })
	if err != nil || cfg.Server() != "https://[fd00::1]:443" {
		t.Errorf("IPv6: %v %v", cfg, err)
	}

	for name, setup := range map[string]func(d string) map[string]string{
		"KUBERNETES_SERVICE_HOST": func(string) map[string]string { return map[string]string{"KUBERNETES_SERVICE_PORT": "443"} },
		"token": func(d string) map[string]string {
			writeFile(t, filepath.Join(d, "ca.crt"), f.caPEM)
			return env
		},
		"ca.crt": func(d string) map[string]string {
			writeFile(t, filepath.Join(d, "token"), []byte("x"))
			return env
		},
		"no PEM": func(d string) map[string]string {
			writeFile(t, filepath.Join(d, "token"), []byte("x"))
			writeFile(t, filepath.Join(d, "ca.crt"), []byte("junk"))
			return env
		},
	} {
		d := t.TempDir()
		e := setup(d)
		_, err := inClusterConfig(d, func(k string) string { return e[k] })
		if err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: got %v", name, err)
		}
	}
}

func TestMalformedKubeconfigs(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{})
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "notpem"), []byte("hello"))
	writeFile(t, filepath.Join(dir, "empty"), nil)
	ca, cert, key := b64(f.caPEM), b64(f.certPEM), b64(f.keyPEM)
	_, otherKey := f.clientCA.Issue(t, "other", false, nil, nil)

	kc := func(cluster, user string) string {
		return fmt.Sprintf(`current-context: foo
clusters:
- name: c
  cluster:
%s
contexts:
- name: foo
  context:
    cluster: c
    user: bar
users:
- name: bar
  user:
%s
    token: %s
`, cluster, user, sampleToken)
	}
	okCluster := "    server: https://127.0.0.1:6443\n    certificate-authority-data: " + ca
	okUser := "    client-certificate-data: " + cert + "\n    client-key-data: " + key

	tests := []struct {
		name, yaml, context, want string
	}{
		{"bad key base64", kc(okCluster, "    client-certificate-data: "+cert+"\n    client-key-data: '%%%'"), "",
			`context "foo": user "bar": client-key-data: not valid base64`},
		{"bad CA base64", kc("    server: https://x\n    certificate-authority-data: 'not*base64'", okUser), "",
			`context "foo": cluster "c": certificate-authority-data: not valid base64`},
		{"CA not PEM", kc("    server: https://x\n    certificate-authority-data: "+b64([]byte("nope")), okUser), "",
			`cluster "c": certificate-authority-data: no PEM certificates found`},
		{"CA file missing", kc("    server: https://x\n    certificate-authority: ca.crt", okUser), "",
			`cluster "c": certificate-authority: stat ` + filepath.Join(dir, "ca.crt") + ": no such file"},
		{"CA file not PEM", kc("    server: https://x\n    certificate-authority: notpem", okUser), "",
			`certificate-authority: no PEM certificates found`},
		{"CA file is a directory", kc("    server: https://x\n    certificate-authority: /", okUser), "",
			`certificate-authority: /: not a regular file`},
		{"CA file empty", kc("    server: https://x\n    certificate-authority: empty", okUser), "",
			`certificate-authority: file is empty`},
		{"insecure and CA", kc(okCluster+"\n    insecure-skip-tls-verify: true", okUser), "",
			`insecure-skip-tls-verify: not allowed together with certificate-authority-data`},
		{"insecure not bool", kc(okCluster+"\n    insecure-skip-tls-verify: maybe", okUser), "",
			`cluster "c": insecure-skip-tls-verify: line 7: expected true or false`},
		{"no server", kc("    certificate-authority-data: "+ca, okUser), "",
			`cluster "c": server: not set`},
		{"server scheme", kc("    server: ftp://x", okUser), "", `server: must be an https:// or http:// URL`},
		{"server not a string", kc("    server: [a, b]", okUser), "", `server: line 5: expected a string`},
		{"server with password", kc("    server: https://u:p@x", okUser), "", `server: must not contain user info`},
		{"proxy-url", kc(okCluster+"\n    proxy-url: socks5://x", okUser), "", `proxy-url: must be an http:// or https:// URL`},
		{"cert without key", kc(okCluster, "    client-certificate-data: "+cert), "",
			`user "bar": client-key-data or client-key: not set (client-certificate-data is set)`},
		{"key without cert", kc(okCluster, "    client-key: /k"), "",
			`user "bar": client-key: stat /k: no such file`},
		{"key file without cert", kc(okCluster, "    client-key: notpem"), "",
			`client-certificate-data or client-certificate: not set (client-key is set)`},
		{"mismatched key", kc(okCluster, "    client-certificate-data: "+cert+"\n    client-key-data: "+b64(otherKey)), "",
			`user "bar": client-certificate-data, client-key-data: tls: private key does not match public key`},
		{"cert not PEM", kc(okCluster, "    client-certificate: notpem\n    client-key-data: "+key), "",
			`user "bar": client-certificate, client-key-data: tls: failed to find any PEM data in certificate input`},
		{"tokenFile missing", kc(okCluster, "    tokenFile: tok"), "",
			`user "bar": tokenFile: read token: stat ` + filepath.Join(dir, "tok")},
		{"tokenFile empty", kc(okCluster, "    tokenFile: empty"), "", `user "bar": tokenFile: token file ` + filepath.Join(dir, "empty") + ` is empty`},
		{"exec plugin", kc(okCluster, "    exec: {command: aws}"), "", `user "bar": exec: credential plugins are not supported`},
		{"auth-provider", kc(okCluster, "    auth-provider: {name: gcp}"), "", `user "bar": auth-provider: auth providers are not supported`},
		{"basic auth", kc(okCluster, "    username: admin"), "", `user "bar": username: basic authentication is not supported`},
		{"impersonation", kc(okCluster, "    as: admin"), "", `user "bar": as: impersonation is not supported`},
		{"token not a string", strings.Replace(kc(okCluster, okUser), "token: ", "token:\n      - ", 1), "", `user "bar": token: line 18: expected a string`},
		{"user missing", strings.Replace(kc(okCluster, okUser), "user: bar", "user: baz", 1), "", `context "foo": user "baz": not found`},
		{"cluster missing", strings.Replace(kc(okCluster, okUser), "cluster: c", "cluster: d", 1), "", `context "foo": cluster "d": not found`},
		{"context has no cluster", strings.Replace(kc(okCluster, okUser), "cluster: c", "namespace: x", 1), "", `context "foo": cluster: not set`},
		{"context missing", kc(okCluster, okUser), "nope", `context "nope": not found`},
		{"no current-context", strings.Replace(kc(okCluster, okUser), "current-context: foo", "", 1), "", `current-context: not set`},
		{"clusters not a list", "current-context: a\nclusters: {a: b}\ncontexts: [{name: a, context: {cluster: a}}]\n", "", `clusters: line 2: expected a list`},
		{"context entry not a mapping", "current-context: a\ncontexts: [x]\n", "", `contexts[0]: line 2: expected a mapping`},
		{"entry without name", "current-context: a\ncontexts: [{context: {cluster: a}}]\n", "", `contexts[0]: name: not set`},
		{"duplicate name", "current-context: a\ncontexts: [{name: a}, {name: a}]\n", "", `contexts[1]: name "a": defined twice`},
		{"duplicate key", "current-context: a\ncurrent-context: b\n", "", `top level: line 2: duplicate key`},
		{"top level list", "- a\n- b\n", "", `top level: line 1: expected a mapping`},
		{"empty", "", "", `kubeconfig ` + filepath.Join(dir, "kubeconfig") + `: empty`},
		{"not yaml", "current-context: [\n", "", `not valid YAML: line 1`},
		{"tabs", "a:\n\tb: c\n", "", `not valid YAML: line 2: found character that cannot start any token`},
		{"alias to no anchor", "current-context: *tok-secret-value\n", "", `not valid YAML: not YAML this reader accepts`},
		{"two documents", "current-context: a\n---\ncurrent-context: b\n", "", `not valid YAML: line 2: a second document`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, "kubeconfig")
			writeFile(t, path, []byte(tc.yaml))
			_, err := LoadKubeconfig(path, tc.context)
			if err == nil {
				t.Fatalf("accepted:\n%s", tc.yaml)
			}
			if !strings.HasPrefix(err.Error(), "kubeconfig "+path+": ") {
				t.Errorf("error %q does not start with the kubeconfig path", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q\ndoes not contain %q", err, tc.want)
			}
			noToken(t, err, key, string(otherKey[30:60]), "tok-secret-value")
		})
	}
	big := append([]byte("current-context: a\n#"), bytes.Repeat([]byte("x"), maxKubeconfigSize)...)
	if _, err := ParseKubeconfig(big, dir, ""); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("a kubeconfig past the size bound: %v", err)
	}

	// The exact shape promised in the docs.
	path := filepath.Join(dir, "kubeconfig")
	writeFile(t, path, []byte(tests[0].yaml))
	_, err := LoadKubeconfig(path, "")
	if want := "kubeconfig " + path + `: context "foo": user "bar": client-key-data: not valid base64`; err == nil || err.Error() != want {
		t.Errorf("got %v\nwant %s", err, want)
	}
	if _, err := LoadKubeconfig(filepath.Join(dir, "absent"), ""); err == nil || !strings.Contains(err.Error(), "absent") {
		t.Errorf("missing kubeconfig: %v", err)
	}
	if _, err := ParseKubeconfig([]byte("current-context: x\n"), dir, ""); err == nil || !strings.HasPrefix(err.Error(), `kubeconfig: context "x": not found`) {
		t.Errorf("ParseKubeconfig prefix: %v", err)
	}
}

// Anchors and aliases are valid YAML and occasionally used in kubeconfigs.
func TestKubeconfigAliases(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{requireClientCert: true})
	y := fmt.Sprintf(`current-context: main
clusters:
- name: fake
  cluster: &cl
    server: %s
    certificate-authority-data: %s
- name: copy
  cluster: *cl
contexts:
- name: main
  context: {cluster: copy, user: server}
users:
- name: server
  user:
    client-certificate-data: %s
    client-key-data: %s
`, f.url(), b64(f.caPEM), b64(f.certPEM), b64(f.keyPEM))
	if err := probe(t, f, load(t, t.TempDir(), y, "")); err != nil {
		t.Fatal(err)
	}
}

// JSON is YAML: kubeconfigs written as JSON load too.
func TestKubeconfigJSON(t *testing.T) {
	f := newFakeAPIServer(t, fakeOpts{})
	f.wantBearer = "json-token"
	y := fmt.Sprintf(`{"current-context":"c","clusters":[{"name":"k","cluster":{"server":%q,"certificate-authority-data":%q}}],
"contexts":[{"name":"c","context":{"cluster":"k","user":"u"}}],"users":[{"name":"u","user":{"token":"json-token"}}]}`, f.url(), b64(f.caPEM))
	if err := probe(t, f, load(t, t.TempDir(), y, "")); err != nil {
		t.Fatal(err)
	}
}

// The token must not show up in any error of a kubeconfig that has it
// and fails elsewhere.
func TestTokenNeverInKubeconfigErrors(t *testing.T) {
	for i, y := range []string{
		"current-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\nclusters: [{name: k, cluster: {server: 'ftp://x'}}]\nusers: [{name: u, user: {token: " + sampleToken + "}}]\n",
		"current-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\nclusters: [{name: k, cluster: {server: 'https://x'}}]\nusers: [{name: u, user: {token: " + sampleToken + ", client-key-data: '!'}}]\n",
		"current-context: c\nusers: [{name: u, user: {token: " + sampleToken + "}}]\nusers: []\n",
		"users:\n- name: u\n  user: {token: " + sampleToken + "\n",
		"clusters: [{name: k, cluster: {insecure-skip-tls-verify: " + sampleToken + "}}]\ncurrent-context: c\ncontexts: [{name: c, context: {cluster: k}}]\n",
	} {
		_, err := ParseKubeconfig([]byte(y), "", "")
		if err == nil {
			t.Errorf("case %d: no error", i)
			continue
		}
		noToken(t, err)
		// Even a fragment (the signature part) must not leak.
		if strings.Contains(err.Error(), sampleToken[strings.LastIndexByte(sampleToken, '.')+1:]) {
			t.Errorf("case %d leaks part of the token: %v", i, err)
		}
	}
}
