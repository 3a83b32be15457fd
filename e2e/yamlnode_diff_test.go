package e2e

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/spinifex/konnectivity/internal/yamlnode"
	"gopkg.in/yaml.v3"
)

// The kubeconfig reader (internal/yamlnode) must read every kubeconfig the
// way yaml.v3 does. These are written out as kubectl, kubeadm, k3s, kind and
// EKS write them, plus the shapes the auth tests use.
var kubeconfigCorpus = map[string]string{
	"kubectl": `apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUJkekNDQVIyZ0F3SUJBZ0lCQURBS0JnZ3Foa2pPUFFRREFqQWpNU0V3SHdZRFZRUUREQmhyTTNNdGMyVnkKLS0tLS1FTkQgQ0VSVElGSUNBVEUtLS0tLQo=
    server: https://127.0.0.1:6443
  name: kubernetes
contexts:
- context:
    cluster: kubernetes
    namespace: kube-system
    user: kubernetes-admin
  name: kubernetes-admin@kubernetes
current-context: kubernetes-admin@kubernetes
kind: Config
preferences: {}
users:
- name: kubernetes-admin
  user:
    client-certificate-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSURJVENDQWdtZ0F3SUJBZ0lJWjJx
    client-key-data: LS0tLS1CRUdJTiBSU0EgUFJJVkFURSBLRVktLS0tLQpNSUlFb3dJQkFBS0NBUUVBdGVzdA==
`,
	"kubeadm konnectivity": `apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority: /etc/kubernetes/pki/ca.crt
    server: https://192.168.10.2:6443
  name: kubernetes
contexts:
- context:
    cluster: kubernetes
    user: system:konnectivity-server
  name: system:konnectivity-server@kubernetes
current-context: system:konnectivity-server@kubernetes
users:
- name: system:konnectivity-server
  user:
    client-certificate: /etc/kubernetes/pki/konnectivity.crt
    client-key: /etc/kubernetes/pki/konnectivity.key
`,
	"k3s": `apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t
    server: https://127.0.0.1:6443
  name: default
contexts:
- context:
    cluster: default
    user: default
  name: default
current-context: default
kind: Config
preferences: {}
users:
- name: default
  user:
    client-certificate-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t
    client-key-data: LS0tLS1CRUdJTiBFQyBQUklWQVRFIEtFWS0tLS0t
`,
	"kind": `apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t
    server: https://127.0.0.1:39555
  name: kind-kind
contexts:
- context:
    cluster: kind-kind
    user: kind-kind
  name: kind-kind
current-context: kind-kind
kind: Config
preferences: {}
users:
- name: kind-kind
  user:
    client-certificate-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t
    client-key-data: LS0tLS1CRUdJTiBSU0EgUFJJVkFURSBLRVktLS0tLQ==
`,
	"eks exec": `apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t
    server: https://ABCDEF0123456789.gr7.us-west-2.eks.amazonaws.com
  name: arn:aws:eks:us-west-2:111122223333:cluster/my-cluster
contexts:
- context:
    cluster: arn:aws:eks:us-west-2:111122223333:cluster/my-cluster
    user: arn:aws:eks:us-west-2:111122223333:cluster/my-cluster
  name: arn:aws:eks:us-west-2:111122223333:cluster/my-cluster
current-context: arn:aws:eks:us-west-2:111122223333:cluster/my-cluster
kind: Config
preferences: {}
users:
- name: arn:aws:eks:us-west-2:111122223333:cluster/my-cluster
  user:
    exec:
      apiVersion: client.authentication.k8s.io/v1beta1
      args:
      - --region
      - us-west-2
      - eks
      - get-token
      - --cluster-name
      - my-cluster
      - --output
      - json
      command: aws
      env:
      - name: AWS_PROFILE
        value: "prod"
      interactiveMode: IfAvailable
      provideClusterInfo: false
`,
	"gke auth-provider": `apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t
    server: https://35.1.2.3
  name: gke_proj_us-central1-a_c1
contexts:
- context:
    cluster: gke_proj_us-central1-a_c1
    user: gke_proj_us-central1-a_c1
  name: gke_proj_us-central1-a_c1
current-context: gke_proj_us-central1-a_c1
kind: Config
preferences: {}
users:
- name: gke_proj_us-central1-a_c1
  user:
    auth-provider:
      config:
        access-token: ya29.a0AfH6SMBx
        cmd-args: config config-helper --format=json
        cmd-path: /usr/lib/google-cloud-sdk/bin/gcloud
        expiry: "2026-12-01T18:00:00Z"
        expiry-key: '{.credential.token_expiry}'
        token-key: '{.credential.access_token}'
      name: gcp
`,
	"hand written": `# written by hand
---
apiVersion: v1
kind: Config
current-context: "dev"   # quoted
clusters:
  - name: 'dev'
    cluster:
      server: "https://10.0.0.1:6443/"
      insecure-skip-tls-verify: true
      tls-server-name: kubernetes.default.svc
      proxy-url: http://proxy.example:3128
  - name: 'it''s'
    cluster: {server: "https://[::1]:6443", certificate-authority: ./ca.crt}
contexts:
  - {name: dev, context: {cluster: dev, user: dev, namespace: default}}
users:
  - name: dev
    user:
      token: "abc.def\tghi\u00e9\x41"
      tokenFile: ~
      as-groups: []
      extra: null
...
`,
	"block scalars":   "a: |\n  line 1\n  line 2\n\n  line 4\nb: >\n  folded\n  text\n\n  para\n    more\n  back\nc: |-\n  strip\n\nd: |+\n  keep\n\ne: >-\n  x\n  y\nf: |2\n    indented\ng: |\n\n  leading blank\nh: end\n",
	"plain multiline": "a: one\n  two\n\n  three\nb: x # comment\nc: a:b#c\nlist:\n- - nested\n  - seq\n- key: v\n  other: w\n-\n- ''\n",
	"crlf bom":        "\ufeffcurrent-context: a\r\nclusters:\r\n- name: a\r\n  cluster:\r\n    server: https://x\r\n",
	"json": `{"apiVersion":"v1","kind":"Config","current-context":"c","clusters":[{"name":"k","cluster":{"server":"https://127.0.0.1:6443","certificate-authority-data":"LS0tLS1CRUdJTg==","insecure-skip-tls-verify":false}}],
"contexts":[{"name":"c","context":{"cluster":"k","user":"u"}}],
"users":[{"name":"u","user":{"token":"json-token","exec":null}}],"preferences":{},"n":1.5e3,"t":true}`,
	"json pretty":           "{\n  \"kind\": \"Config\",\n  \"clusters\": [\n    {\n      \"name\": \"k\",\n      \"cluster\": {\n        \"server\": \"https://x\"\n      }\n    }\n  ],\n  \"users\": []\n}\n",
	"aliases":               "current-context: main\nclusters:\n- name: fake\n  cluster: &cl\n    server: https://x\n- name: copy\n  cluster: *cl\nusers:\n- name: u\n  user: &u {token: t}\n- {name: v, user: *u}\n",
	"tags":                  "a: !!str 123\nb: !!null ''\nc: !!bool true\nd: !!map {x: y}\ne: !!seq [1]\nf: !!str\ng: !!binary aGVsbG8=\n",
	"empty values":          "a:\nb: ~\nc: null\nd: ''\ne: \"\"\nf: {}\ng: []\nh:\n  -\n  - x\n",
	"document marker value": "--- {a: b}\n",
	"quoted multiline":      "a: \"one\n  two\n\n  three\"\nb: 'x\n  y'\nc: \"esc\\\n  aped\"\n",
	"auth tests":            "current-context: foo\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:6443\n    certificate-authority-data: QUJD\ncontexts:\n- name: foo\n  context:\n    cluster: c\n    user: bar\nusers:\n- name: bar\n  user:\n    client-certificate-data: QUJD\n    client-key-data: '%%%'\n    token:\n      - x\n",
}

func TestYAMLNodeMatchesYAMLv3(t *testing.T) {
	for name, doc := range kubeconfigCorpus {
		t.Run(name, func(t *testing.T) {
			got, err := yamlnode.Parse([]byte(doc))
			if err != nil {
				t.Fatalf("yamlnode refused: %v", err)
			}
			var want yaml.Node
			if err := yaml.Unmarshal([]byte(doc), &want); err != nil {
				t.Fatalf("yaml.v3 refused: %v", err)
			}
			if d := diffNodes(got, docRoot(&want), "$", 0); d != "" {
				t.Error(d)
			}
		})
	}
	// The fuzz seeds: wherever yaml.v3 accepts and the reader does not
	// refuse, the trees must agree.
	var files []string
	for _, dir := range []string{"../internal/yamlnode/testdata/fuzz/FuzzParse", "../auth/testdata/fuzz/FuzzLoadKubeconfig"} {
		m, _ := filepath.Glob(filepath.Join(dir, "*"))
		files = append(files, m...)
	}
	compared := 0
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		data, ok := fuzzBytes(string(raw))
		if !ok {
			continue
		}
		var want yaml.Node
		if yaml.Unmarshal(data, &want) != nil {
			continue
		}
		got, err := yamlnode.Parse(data)
		if err != nil {
			continue
		}
		compared++
		if d := diffNodes(got, docRoot(&want), "$", 0); d != "" {
			t.Errorf("%s: %s", filepath.Base(f), d)
		}
	}
	if compared == 0 {
		t.Error("no fuzz seed compared")
	}
}

// fuzzBytes returns the first []byte value of a "go test fuzz v1" file.
func fuzzBytes(file string) ([]byte, bool) {
	for _, line := range strings.Split(file, "\n") {
		if s, ok := strings.CutPrefix(line, "[]byte("); ok {
			v, err := strconv.Unquote(strings.TrimSuffix(s, ")"))
			return []byte(v), err == nil
		}
	}
	return nil, false
}

func docRoot(n *yaml.Node) *yaml.Node {
	if n.Kind == yaml.DocumentNode && len(n.Content) > 0 {
		return n.Content[0]
	}
	if n.Kind == 0 {
		return nil
	}
	return n
}

// diffNodes describes the first difference between the two trees, or "".
func diffNodes(got *yamlnode.Node, want *yaml.Node, path string, depth int) string {
	for want != nil && want.Kind == yaml.AliasNode {
		want = want.Alias
	}
	if depth > 100 {
		return ""
	}
	switch {
	case got == nil && want == nil:
		return ""
	case got == nil || want == nil:
		return path + ": one tree has no node"
	}
	wantNull := want.Kind == yaml.ScalarNode && want.ShortTag() == "!!null"
	if got.IsNull() != wantNull {
		return path + ": null differs: got " + strconv.Quote(got.Value) + ", want " + strconv.Quote(want.Value)
	}
	kinds := map[yaml.Kind]yamlnode.Kind{yaml.ScalarNode: yamlnode.Scalar, yaml.MappingNode: yamlnode.Mapping, yaml.SequenceNode: yamlnode.Sequence}
	if kinds[want.Kind] != got.Kind {
		return path + ": kinds differ"
	}
	if got.Line != want.Line && !wantNull {
		return path + ": line " + strconv.Itoa(got.Line) + ", want " + strconv.Itoa(want.Line)
	}
	if got.Kind == yamlnode.Scalar {
		if got.Value != want.Value {
			return path + ": got " + strconv.Quote(got.Value) + ", want " + strconv.Quote(want.Value)
		}
		return ""
	}
	if len(got.Content) != len(want.Content) {
		return path + ": lengths differ: got " + strconv.Itoa(len(got.Content)) + ", want " + strconv.Itoa(len(want.Content))
	}
	for i := range got.Content {
		p := path + "[" + strconv.Itoa(i) + "]"
		if got.Kind == yamlnode.Mapping && i%2 == 1 {
			p = path + "." + got.Content[i-1].Value
		}
		if d := diffNodes(got.Content[i], want.Content[i], p, depth+1); d != "" {
			return d
		}
	}
	return ""
}

// FuzzYAMLNodeMatchesYAMLv3 looks for documents both readers accept but
// read differently: go test -fuzz FuzzYAMLNodeMatchesYAMLv3 -run XXX .
func FuzzYAMLNodeMatchesYAMLv3(f *testing.F) {
	for _, doc := range kubeconfigCorpus {
		f.Add([]byte(doc))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var want yaml.Node
		if yaml.Unmarshal(data, &want) != nil {
			return
		}
		got, err := yamlnode.Parse(data)
		if err != nil {
			return
		}
		if d := diffNodes(got, docRoot(&want), "$", 0); d != "" {
			t.Errorf("%q: %s", data, d)
		}
	})
}
