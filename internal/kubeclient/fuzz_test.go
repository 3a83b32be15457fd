package kubeclient

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spinifex/konnectivity/internal/testpki"
)

// FuzzLoadKubeconfig feeds arbitrary bytes and context names to the
// kubeconfig parser: it must never panic, hang, or put the token in an error,
// and whatever it accepts must be usable.
func FuzzLoadKubeconfig(f *testing.F) {
	dir := f.TempDir()
	ca := testpki.NewCA(f, "fuzz-ca")
	cert, key := ca.Issue(f, "fuzz-client", false, nil, nil)
	writeFile(f, filepath.Join(dir, "ca.crt"), ca.PEM)
	writeFile(f, filepath.Join(dir, "client.crt"), cert)
	writeFile(f, filepath.Join(dir, "client.key"), key)
	writeFile(f, filepath.Join(dir, "token"), []byte(sampleToken))

	full := fmt.Sprintf(`apiVersion: v1
kind: Config
current-context: a
clusters:
- name: k
  cluster: {server: "https://127.0.0.1:6443", certificate-authority-data: %s, tls-server-name: kubernetes}
contexts:
- name: a
  context: {cluster: k, user: u}
- name: b
  context: {cluster: k2, user: u2}
users:
- name: u
  user: {client-certificate-data: %s, client-key-data: %s, token: %s}
`, b64(ca.PEM), b64(cert), b64(key), sampleToken)
	files := `current-context: a
clusters: [{name: k, cluster: {server: "10.0.0.1:6443", certificate-authority: ca.crt}}, {name: k2, cluster: {server: "http://h", insecure-skip-tls-verify: true}}]
contexts: [{name: a, context: {cluster: k, user: u}}, {name: b, context: {cluster: k2, user: v}}]
users: [{name: u, user: {client-certificate: client.crt, client-key: ./client.key}}, {name: v, user: {tokenFile: token}}]
`
	for _, seed := range []struct{ data, context string }{
		{full, ""},
		{full, "b"},
		{files, ""},
		{files, "b"},
		{`{"current-context":"a","contexts":[{"name":"a","context":{"cluster":"k"}}],"clusters":[{"name":"k","cluster":{"server":"https://x"}}]}`, ""},
		{"current-context: a\ncontexts: [{name: a, context: &x {cluster: *x}}]\n", ""},
		{"a: &a [*a, *a]\n", ""},
		{"clusters: [{name: k, cluster: {insecure-skip-tls-verify: " + sampleToken + "}}]\ncurrent-context: c\ncontexts: [{name: c, context: {cluster: k}}]\n", ""},
		{"users: [{name: u, user: {token: " + sampleToken + ", client-key-data: '!!'}}]\ncurrent-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\nclusters: [{name: k, cluster: {server: x}}]\n", ""},
		{"current-context: a\ncontexts: [{name: a, context: {cluster: k}}]\nclusters: [{name: k, cluster: {server: x, certificate-authority: /proc/kmsg}}]\n", ""},
		{"", ""},
		{"\t", "x"},
		{"---\n---\n", ""},
	} {
		f.Add([]byte(seed.data), seed.context)
	}

	// Only files in dir may be read: fuzzed paths like /proc/kmsg would block.
	sandbox := func(path string, limit int64) ([]byte, error) {
		if !strings.HasPrefix(filepath.Clean(path), dir+string(filepath.Separator)) {
			return nil, fmt.Errorf("%s: %w", path, os.ErrPermission)
		}
		return readRegularFile(path, limit)
	}
	f.Fuzz(func(t *testing.T, data []byte, context string) {
		cfg, err := parseKubeconfig(data, dir, context, sandbox)
		if err != nil {
			// The token may appear in the input as a context or cluster
			// name, which errors quote; it must not leak from a token field.
			if strings.Contains(err.Error(), sampleToken) && !strings.Contains(string(data), "name: "+sampleToken) &&
				!strings.Contains(string(data), "context: "+sampleToken) && !strings.Contains(context, sampleToken) &&
				!strings.Contains(string(data), "cluster: "+sampleToken) && !strings.Contains(string(data), "user: "+sampleToken) {
				t.Fatalf("error leaks token: %v", err)
			}
			return
		}
		if !strings.HasPrefix(cfg.Server(), "https://") && !strings.HasPrefix(cfg.Server(), "http://") {
			t.Fatalf("accepted server %q", cfg.Server())
		}
		if strings.Contains(cfg.String(), sampleToken) {
			t.Fatalf("String() leaks token")
		}
		if cfg.httpClient() == nil {
			t.Fatal("no client")
		}
	})
}
