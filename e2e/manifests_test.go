package e2e

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/server/egressselector"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"
)

// Paths inside the node image (relative to /), as images/build-overlay.sh
// lays them out.
const (
	niManifestDir   = "var/lib/rancher/k3s/server/manifests"
	niAgentManifest = niManifestDir + "/konnectivity-agent.yaml"
	niK3sConfigDir  = "etc/rancher/k3s/config.yaml.d"
	niAgentImage    = "var/lib/rancher/k3s/agent/images/konnectivity-agent.tar"
	niServerInitd   = "etc/init.d/konnectivity-server"
	niServerConfd   = "etc/conf.d/konnectivity-server"
	niImageRepo     = "docker.io/spinifex/konnectivity-agent"
	niAudience      = "system:konnectivity-server"
	niNamespace     = "kube-system"
	niAgentName     = "konnectivity-agent"
	niFallbackTag   = "v0.0.0-e2e" // stands in for @VERSION@ when no image archive exists
)

// nodeImage is the konnectivity part of the node image's file system, held
// in memory: paths relative to / → contents.
type nodeImage struct {
	files map[string][]byte
}

func (ni nodeImage) file(t *testing.T, p string) []byte {
	t.Helper()
	b, ok := ni.files[p]
	if !ok {
		t.Fatalf("node image has no /%s", p)
	}
	return b
}

// under lists the files directly in dir, sorted.
func (ni nodeImage) under(dir, ext string) []string {
	var out []string
	for p := range ni.files {
		if path.Dir(p) == dir && strings.HasSuffix(p, ext) {
			out = append(out, p)
		}
	}
	slices.Sort(out)
	return out
}

// TestNodeImage decodes the node image's Kubernetes manifests and kube-apiserver
// egress configuration strictly with the Kubernetes API types (unknown and
// duplicate fields rejected), then checks that they agree with each other,
// with the server init script and with the agent binary and image. It checks
// the source tree (with @VERSION@ replaced as the overlay build does) and the
// built overlay: $KONNECTIVITY_OVERLAY if set, else one built here with
// images/build-overlay.sh when an agent image archive exists, else
// ../bin/eks-node-overlay.tar.gz if present.
func TestNodeImage(t *testing.T) {
	agentFlags := niAgentFlags(t)
	t.Run("source", func(t *testing.T) {
		t.Parallel()
		ni, archive := niFromSource(t)
		niCheck(t, ni, archive, agentFlags)
	})
	t.Run("overlay", func(t *testing.T) {
		t.Parallel()
		tarball := niOverlayTarball(t)
		ni := niFromTarball(t, tarball)
		var archive []byte
		if b, ok := ni.files[niAgentImage]; ok {
			archive = b
		}
		for p, b := range ni.files {
			if bytes.Contains(b, []byte("@VERSION@")) {
				t.Errorf("overlay %s: /%s still holds @VERSION@", tarball, p)
			}
		}
		for _, p := range []string{"usr/local/bin/konnectivity", niServerInitd, niServerConfd} {
			if _, ok := ni.files[p]; !ok {
				t.Errorf("overlay %s has no /%s", tarball, p)
			}
		}
		niCheck(t, ni, archive, agentFlags)
	})
}

// niAgentImageArchive returns the agent image archive `make agent-image`
// writes, or "" if there is none.
func niAgentImageArchive(t *testing.T) string {
	t.Helper()
	p := os.Getenv("AGENT_IMAGE")
	if p == "" {
		p = filepath.Join("..", "bin", "konnectivity-agent-image.tar")
	}
	if _, err := os.Stat(p); err != nil {
		if os.Getenv("AGENT_IMAGE") != "" {
			t.Fatalf("AGENT_IMAGE: %v", err)
		}
		return ""
	}
	return p
}

// niFromSource reads images/eks-node and the OpenRC files the overlay copies,
// with @VERSION@ replaced by the tag of the agent image archive if there is
// one (returned too), else by a fixed valid tag.
func niFromSource(t *testing.T) (nodeImage, []byte) {
	t.Helper()
	ni := nodeImage{files: map[string][]byte{}}
	tree := filepath.Join("..", "images", "eks-node")
	err := filepath.WalkDir(tree, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(tree, p)
		if err != nil {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		ni.files[filepath.ToSlash(rel)] = b
		return nil
	})
	if err != nil {
		t.Fatalf("read %s: %v", tree, err)
	}
	for _, svc := range []string{"konnectivity-server", "konnectivity-agent"} {
		for _, kind := range []string{"initd", "confd"} {
			src := filepath.Join("..", "openrc", svc+"."+kind)
			b, err := os.ReadFile(src)
			if err != nil {
				t.Fatalf("read %s: %v", src, err)
			}
			dir := map[string]string{"initd": "etc/init.d", "confd": "etc/conf.d"}[kind]
			ni.files[dir+"/"+svc] = b
		}
	}

	tag := niFallbackTag
	var archive []byte
	if p := niAgentImageArchive(t); p != "" {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("read agent image: %v", err)
		}
		archive = b
		name := niImageName(t, archive)
		var ok bool
		if tag, ok = strings.CutPrefix(name, niImageRepo+":"); !ok {
			t.Fatalf("agent image archive %s is %s, want %s:<tag>", p, name, niImageRepo)
		}
	}
	m := ni.file(t, niAgentManifest)
	// build-overlay.sh substitutes it everywhere; outside comments it must be
	// exactly the image tag.
	uses := regexp.MustCompile(`(?m)^[^#\n]*@VERSION@`).FindAll(m, -1)
	if len(uses) != 1 || !regexp.MustCompile(`^ *image: \S+:@VERSION@$`).Match(uses[0]) {
		t.Errorf("source %s: @VERSION@ outside comments in %q, want exactly one `image: NAME:@VERSION@` line", niAgentManifest, uses)
	}
	ni.files[niAgentManifest] = bytes.ReplaceAll(m, []byte("@VERSION@"), []byte(tag))
	return ni, archive
}

// niOverlayTarball returns the overlay tarball to check, building one in a
// temporary directory if it can; it skips the test if there is none.
func niOverlayTarball(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("KONNECTIVITY_OVERLAY"); p != "" {
		return p
	}
	if image := niAgentImageArchive(t); image != "" && konnectivityBin != "" {
		if out, err := exec.Command("tar", "--version").Output(); err == nil && bytes.Contains(out, []byte("GNU tar")) {
			out := filepath.Join(t.TempDir(), "overlay.tar.gz")
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, "sh", filepath.Join("..", "images", "build-overlay.sh"), out, konnectivityBin, image)
			cmd.Env = append(os.Environ(), "SOURCE_DATE_EPOCH=0")
			if b, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("build-overlay.sh: %v\n%s", err, b)
			}
			return out
		}
	}
	p := filepath.Join("..", "bin", "eks-node-overlay.tar.gz")
	if _, err := os.Stat(p); err != nil {
		t.Skip("no overlay: set KONNECTIVITY_OVERLAY, or make agent-image (GNU tar needed) or make image-overlay")
	}
	return p
}

func niFromTarball(t *testing.T, p string) nodeImage {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatalf("open overlay: %v", err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatalf("overlay %s: %v", p, err)
	}
	ni := nodeImage{files: map[string][]byte{}}
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("overlay %s: %v", p, err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatalf("overlay %s: %s: %v", p, h.Name, err)
		}
		ni.files[path.Clean(strings.TrimPrefix(h.Name, "./"))] = b
	}
	return ni
}

// niTarFile reads one file of an (uncompressed) tar archive held in memory.
func niTarFile(t *testing.T, archive []byte, name string) []byte {
	t.Helper()
	tr := tar.NewReader(bytes.NewReader(archive))
	for {
		h, err := tr.Next()
		if err != nil {
			t.Fatalf("agent image archive: %s: %v", name, err)
		}
		if path.Clean(h.Name) == name {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatalf("agent image archive: %s: %v", name, err)
			}
			return b
		}
	}
}

// niImageName is the name containerd gives the archive's image on import.
func niImageName(t *testing.T, archive []byte) string {
	t.Helper()
	var index struct {
		Manifests []struct {
			Annotations map[string]string `json:"annotations"`
		} `json:"manifests"`
	}
	if err := json.Unmarshal(niTarFile(t, archive, "index.json"), &index); err != nil {
		t.Fatalf("agent image index.json: %v", err)
	}
	if len(index.Manifests) != 1 {
		t.Fatalf("agent image index.json: %d manifests, want 1", len(index.Manifests))
	}
	name := index.Manifests[0].Annotations["io.containerd.image.name"]
	if name == "" {
		t.Fatal("agent image index.json: no io.containerd.image.name")
	}
	return name
}

// niImageConfig is the runtime configuration of the archive's image.
func niImageConfig(t *testing.T, archive []byte) (user string, entrypoint []string) {
	t.Helper()
	var index struct {
		Manifests []struct{ Digest string } `json:"manifests"`
	}
	if err := json.Unmarshal(niTarFile(t, archive, "index.json"), &index); err != nil || len(index.Manifests) != 1 {
		t.Fatalf("agent image index.json: %v (%d manifests)", err, len(index.Manifests))
	}
	blob := func(digest string) []byte {
		return niTarFile(t, archive, "blobs/"+strings.Replace(digest, ":", "/", 1))
	}
	var manifest struct {
		Config struct{ Digest string } `json:"config"`
	}
	if err := json.Unmarshal(blob(index.Manifests[0].Digest), &manifest); err != nil {
		t.Fatalf("agent image manifest: %v", err)
	}
	var config struct {
		Config struct {
			User       string
			Entrypoint []string
		} `json:"config"`
	}
	if err := json.Unmarshal(blob(manifest.Config.Digest), &config); err != nil {
		t.Fatalf("agent image config: %v", err)
	}
	return config.Config.User, config.Config.Entrypoint
}

// niAgentFlags lists the flags `konnectivity agent` accepts, from its usage.
func niAgentFlags(t *testing.T) map[string]bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// --help exits non-zero (flag.ErrHelp); only the listing matters.
	out, _ := exec.CommandContext(ctx, konnectivityBin, "agent", "--help").CombinedOutput()
	flags := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z0-9][a-z0-9-]*)`).FindAllSubmatch(out, -1) {
		flags[string(m[1])] = true
	}
	if len(flags) < 5 || !flags["proxy-server-host"] {
		t.Fatalf("%s agent --help lists no usable flags:\n%s", konnectivityBin, out)
	}
	return flags
}

// niDecoders decode manifests with every built-in Kubernetes kind registered:
// strict (unknown and duplicate fields are errors) and, to show that the
// strict one is what rejects a document, lax.
func niDecoders(t *testing.T) (strict, lax runtime.Decoder) {
	t.Helper()
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatalf("scheme: %v", err)
	}
	return serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer(),
		serializer.NewCodecFactory(scheme).UniversalDeserializer()
}

// niDocuments splits a multi-document YAML file, leaving out documents that
// hold only comments.
func niDocuments(t *testing.T, name string, data []byte) [][]byte {
	t.Helper()
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var docs [][]byte
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return docs
		}
		if err != nil {
			t.Fatalf("%s: split documents: %v", name, err)
		}
		j, err := yaml.YAMLToJSON(doc) // duplicates are left to the strict decoder
		if err != nil {
			t.Fatalf("%s: document %d: %v", name, len(docs)+1, err)
		}
		if string(bytes.TrimSpace(j)) == "null" {
			continue
		}
		docs = append(docs, doc)
	}
}

// niShellDefaults reads the `: "${NAME:=value}"` defaults of an init script.
func niShellDefaults(script []byte) map[string]string {
	out := map[string]string{}
	for _, m := range regexp.MustCompile(`(?m)^: "\$\{([A-Z_]+):=([^}]*)\}"`).FindAllSubmatch(script, -1) {
		out[string(m[1])] = string(m[2])
	}
	return out
}

func niCheck(t *testing.T, ni nodeImage, archive []byte, agentFlags map[string]bool) {
	serverDefaults := niShellDefaults(ni.file(t, niServerInitd))
	egressPath := niCheckK3sConfig(t, ni)
	niCheckEgress(t, ni, egressPath, serverDefaults)
	ds := niCheckManifests(t, ni, serverDefaults)
	if ds != nil {
		niCheckDaemonSet(t, ni, ds, archive, agentFlags, serverDefaults)
	}
}

// niCheckK3sConfig parses the k3s configuration snippets and returns the
// egress selector configuration file they give kube-apiserver.
func niCheckK3sConfig(t *testing.T, ni nodeImage) string {
	t.Helper()
	files := ni.under(niK3sConfigDir, ".yaml")
	if len(files) == 0 {
		t.Fatalf("no k3s configuration in /%s", niK3sConfigDir)
	}
	var egressPath string
	for _, p := range files {
		var cfg map[string]any
		if err := yaml.UnmarshalStrict(ni.files[p], &cfg); err != nil {
			t.Errorf("/%s: %v", p, err)
			continue
		}
		for _, key := range []string{"kube-apiserver-arg", "kube-apiserver-arg+"} {
			v, ok := cfg[key]
			if !ok {
				continue
			}
			args, ok := v.([]any)
			if !ok {
				t.Errorf("/%s: %s is %T, want a list", p, key, v)
				continue
			}
			for _, a := range args {
				s, _ := a.(string)
				if f, ok := strings.CutPrefix(s, "egress-selector-config-file="); ok {
					if egressPath != "" {
						t.Errorf("/%s: second egress-selector-config-file %s (first %s)", p, f, egressPath)
					}
					egressPath = f
				}
			}
		}
		if mode, ok := cfg["egress-selector-mode"]; ok && mode != "disabled" {
			// Any other mode makes k3s pass its own egress selector file.
			t.Errorf("/%s: egress-selector-mode %v, want disabled", p, mode)
		}
	}
	if egressPath == "" {
		t.Fatalf("no k3s configuration in /%s passes kube-apiserver egress-selector-config-file", niK3sConfigDir)
	}
	if !path.IsAbs(egressPath) {
		t.Fatalf("egress-selector-config-file %s is not absolute", egressPath)
	}
	if _, ok := ni.files[strings.TrimPrefix(egressPath, "/")]; !ok {
		t.Fatalf("egress-selector-config-file %s is not in the node image", egressPath)
	}
	return strings.TrimPrefix(egressPath, "/")
}

func niCheckEgress(t *testing.T, ni nodeImage, rel string, serverDefaults map[string]string) {
	t.Helper()
	data := ni.file(t, rel)
	p := filepath.Join(t.TempDir(), path.Base(rel))
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	// ReadEgressSelectorConfiguration is what kube-apiserver runs on the
	// file: a strict decode, then conversion to the internal type.
	cfg, err := egressselector.ReadEgressSelectorConfiguration(p)
	if err != nil {
		t.Fatalf("/%s: %v", rel, err)
	}
	if cfg == nil {
		t.Fatalf("/%s: decoded to nothing", rel)
	}
	if errs := egressselector.ValidateEgressSelectorConfiguration(cfg); len(errs) > 0 {
		t.Errorf("/%s: invalid: %v", rel, errs.ToAggregate())
	}
	got := map[string]apiserver.Connection{}
	for _, s := range cfg.EgressSelections {
		got[s.Name] = s.Connection
	}
	if len(got) != 3 || len(cfg.EgressSelections) != 3 {
		t.Errorf("/%s: egress selections %v, want exactly cluster, controlplane, etcd", rel, cfg.EgressSelections)
	}
	for _, name := range []string{"controlplane", "etcd"} {
		if c, ok := got[name]; !ok || c.ProxyProtocol != apiserver.ProtocolDirect || c.Transport != nil {
			t.Errorf("/%s: %s connection %+v, want Direct", rel, name, c)
		}
	}
	cluster, ok := got["cluster"]
	if !ok {
		t.Fatalf("/%s: no cluster egress selection", rel)
	}
	// The protocol must be the one the server init script runs the frontend with.
	wantProto := map[string]apiserver.ProtocolType{
		"http-connect": apiserver.ProtocolHTTPConnect,
		"grpc":         apiserver.ProtocolGRPC,
	}[serverDefaults["KONNECTIVITY_MODE"]]
	if wantProto == "" {
		t.Errorf("/%s: server init script mode %q is unknown", niServerInitd, serverDefaults["KONNECTIVITY_MODE"])
	} else if cluster.ProxyProtocol != wantProto {
		t.Errorf("/%s: cluster proxyProtocol %s, but the server runs --mode=%s", rel, cluster.ProxyProtocol, serverDefaults["KONNECTIVITY_MODE"])
	}
	if cluster.Transport == nil || cluster.Transport.UDS == nil || cluster.Transport.TCP != nil {
		t.Fatalf("/%s: cluster transport %+v, want a UDS", rel, cluster.Transport)
	}
	uds := cluster.Transport.UDS.UDSName
	if want := "/run/konnectivity/konnectivity-server.socket"; uds != want {
		t.Errorf("/%s: cluster udsName %s, want %s", rel, uds, want)
	}
	if got := serverDefaults["KONNECTIVITY_UDS"]; got != uds {
		t.Errorf("/%s: KONNECTIVITY_UDS default %q, but kube-apiserver dials %s", niServerInitd, got, uds)
	}
	// Every socket path written in the server's scripts (comments too) is it.
	sock := regexp.MustCompile(`/[^\s"'}]*konnectivity-server\.socket`)
	for _, f := range []string{niServerInitd, niServerConfd} {
		for _, m := range sock.FindAll(ni.file(t, f), -1) {
			if string(m) != uds {
				t.Errorf("/%s names socket %s, but kube-apiserver dials %s", f, m, uds)
			}
		}
	}

	// Strictness: ReadEgressSelectorConfiguration rejects an unknown field.
	bad := bytes.Replace(data, []byte("\n      uds:\n"), []byte("\n      uds:\n        udsNamee: /x\n"), 1)
	if bytes.Equal(bad, data) {
		t.Fatalf("/%s: cannot find the uds transport to inject an unknown field", rel)
	}
	if err := os.WriteFile(p, bad, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := egressselector.ReadEgressSelectorConfiguration(p); !runtime.IsStrictDecodingError(err) {
		t.Errorf("egress configuration with an unknown field: err = %v, want a strict decoding error", err)
	}
}

// niCheckManifests decodes every document of the auto-deployed manifests
// strictly and returns the agent DaemonSet.
func niCheckManifests(t *testing.T, ni nodeImage, serverDefaults map[string]string) *appsv1.DaemonSet {
	t.Helper()
	strict, lax := niDecoders(t)
	files := ni.under(niManifestDir, ".yaml")
	if len(files) == 0 {
		t.Fatalf("no manifests in /%s", niManifestDir)
	}
	var ds *appsv1.DaemonSet
	var sa *corev1.ServiceAccount
	for _, f := range files {
		for i, doc := range niDocuments(t, f, ni.files[f]) {
			obj, gvk, err := strict.Decode(doc, nil, nil)
			if err != nil {
				t.Errorf("/%s document %d: %v", f, i+1, err)
				continue
			}
			t.Logf("/%s document %d: %s decoded strictly", f, i+1, gvk)
			switch o := obj.(type) {
			case *appsv1.DaemonSet:
				if ds != nil {
					t.Errorf("/%s: second DaemonSet %s", f, o.Name)
				}
				ds = o
				niCheckStrictness(t, f, doc, strict, lax)
			case *corev1.ServiceAccount:
				if o.Name == niAgentName {
					sa = o
				}
			}
		}
	}
	if ds == nil {
		t.Fatalf("no DaemonSet in /%s", niManifestDir)
	}
	if ds.Name != niAgentName || ds.Namespace != niNamespace {
		t.Errorf("DaemonSet %s/%s, want %s/%s", ds.Namespace, ds.Name, niNamespace, niAgentName)
	}
	spec := ds.Spec.Template.Spec
	if spec.ServiceAccountName != niAgentName {
		t.Errorf("DaemonSet serviceAccountName %q, want %s", spec.ServiceAccountName, niAgentName)
	}
	if sa == nil {
		t.Errorf("no ServiceAccount %s in the manifests", niAgentName)
	} else if sa.Namespace != ds.Namespace {
		t.Errorf("ServiceAccount %s in %q, DaemonSet in %q", sa.Name, sa.Namespace, ds.Namespace)
	}
	// The server accepts tokens of exactly this account.
	if got := serverDefaults["KONNECTIVITY_AGENT_NAMESPACE"]; got != ds.Namespace {
		t.Errorf("server KONNECTIVITY_AGENT_NAMESPACE %q, agents run in %q", got, ds.Namespace)
	}
	if got := serverDefaults["KONNECTIVITY_AGENT_SERVICE_ACCOUNT"]; got != spec.ServiceAccountName {
		t.Errorf("server KONNECTIVITY_AGENT_SERVICE_ACCOUNT %q, agents run as %q", got, spec.ServiceAccountName)
	}
	if sel := ds.Spec.Selector; sel == nil || len(sel.MatchLabels) == 0 {
		t.Error("DaemonSet has no selector matchLabels")
	} else {
		for k, v := range sel.MatchLabels {
			if ds.Spec.Template.Labels[k] != v {
				t.Errorf("DaemonSet selector %s=%s does not match the pod template labels %v", k, v, ds.Spec.Template.Labels)
			}
		}
	}
	return ds
}

// niCheckStrictness shows that strict decoding is in force: the document
// with an unknown field, or with a field given twice, decodes leniently but
// not strictly.
func niCheckStrictness(t *testing.T, name string, doc []byte, strict, lax runtime.Decoder) {
	t.Helper()
	line := regexp.MustCompile(`(?m)^( +)imagePullPolicy: .*$`)
	m := line.FindSubmatchIndex(doc)
	if m == nil {
		t.Errorf("/%s: no imagePullPolicy line to tamper with", name)
		return
	}
	indent := string(doc[m[2]:m[3]])
	for what, extra := range map[string]string{
		"unknown field imagePullPolicyy":  indent + "imagePullPolicyy: Always",
		"duplicate field imagePullPolicy": indent + "imagePullPolicy: Always",
	} {
		bad := slices.Concat(doc[:m[1]], []byte("\n"+extra), doc[m[1]:])
		if _, _, err := lax.Decode(bad, nil, nil); err != nil {
			t.Errorf("/%s with %s: lenient decode failed too, so the check proves nothing: %v", name, what, err)
		}
		_, _, err := strict.Decode(bad, nil, nil)
		if err == nil || !runtime.IsStrictDecodingError(err) {
			t.Errorf("/%s with %s: strict decode err = %v, want a strict decoding error", name, what, err)
		}
	}
}

func niCheckDaemonSet(t *testing.T, ni nodeImage, ds *appsv1.DaemonSet, archive []byte, agentFlags map[string]bool, serverDefaults map[string]string) {
	t.Helper()
	spec := ds.Spec.Template.Spec
	if len(spec.Containers) != 1 {
		t.Fatalf("DaemonSet has %d containers, want 1", len(spec.Containers))
	}
	c := spec.Containers[0]

	// Image: the one the node imports from its own archive, never pulled.
	if archive != nil {
		if want := niImageName(t, archive); c.Image != want {
			t.Errorf("container image %q, but the agent image archive is %q", c.Image, want)
		}
		user, entrypoint := niImageConfig(t, archive)
		// runAsNonRoot needs a numeric non-zero user the kubelet can check.
		uid, _, _ := strings.Cut(user, ":")
		if n, err := strconv.Atoi(uid); err != nil || n == 0 {
			if c.SecurityContext != nil && c.SecurityContext.RunAsNonRoot != nil && *c.SecurityContext.RunAsNonRoot && c.SecurityContext.RunAsUser == nil {
				t.Errorf("runAsNonRoot with image user %q: the kubelet refuses to start it", user)
			}
		}
		// The args are agent flags only if the entrypoint is `... agent`.
		if len(entrypoint) == 0 || entrypoint[len(entrypoint)-1] != "agent" || len(c.Command) != 0 {
			t.Errorf("image entrypoint %q, container command %q: args are not given to `konnectivity agent`", entrypoint, c.Command)
		}
	}
	tag, ok := strings.CutPrefix(c.Image, niImageRepo+":")
	if !ok || !regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`).MatchString(tag) {
		t.Errorf("container image %q, want %s:<valid tag>", c.Image, niImageRepo)
	}
	if c.ImagePullPolicy != corev1.PullIfNotPresent {
		t.Errorf("imagePullPolicy %q, want IfNotPresent", c.ImagePullPolicy)
	}

	// Arguments: known agent flags, each once, with every $(VAR) defined.
	args := map[string]string{}
	for _, a := range c.Args {
		name, value, hasValue := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") || !hasValue {
			t.Errorf("arg %q: want --flag=value", a)
			continue
		}
		if !agentFlags[name] {
			t.Errorf("arg %q: `konnectivity agent` has no flag --%s", a, name)
		}
		if _, dup := args[name]; dup {
			t.Errorf("flag --%s given twice", name)
		}
		args[name] = value
	}
	env := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		env[e.Name] = e
	}
	ref := regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)
	for _, a := range c.Args {
		for _, m := range ref.FindAllStringSubmatch(a, -1) {
			if _, ok := env[m[1]]; !ok {
				t.Errorf("arg %q uses $(%s), which the container does not define", a, m[1])
			}
		}
	}
	fieldPath := func(v string) string {
		m := ref.FindStringSubmatch(v)
		if m == nil || m[0] != v {
			return ""
		}
		e := env[m[1]]
		if e.ValueFrom == nil || e.ValueFrom.FieldRef == nil {
			return ""
		}
		return e.ValueFrom.FieldRef.FieldPath
	}
	// destHost routing needs the node's IP: kube-apiserver dials kubelets by it.
	ids, err := url.ParseQuery(args["agent-identifiers"])
	if err != nil {
		t.Errorf("--agent-identifiers %q: %v", args["agent-identifiers"], err)
	}
	if got := fieldPath(ids.Get("ipv4")); got != "status.hostIP" {
		t.Errorf("--agent-identifiers %q: ipv4 comes from %q, want the downward API's status.hostIP", args["agent-identifiers"], got)
	}
	if h := ids.Get("host"); h != "" {
		if got := fieldPath(h); got != "spec.nodeName" {
			t.Errorf("--agent-identifiers %q: host comes from %q, want spec.nodeName", args["agent-identifiers"], got)
		}
	}
	// Where to dial comes from the ConfigMap the server init script writes.
	initd := ni.file(t, niServerInitd)
	for _, e := range c.Env {
		if e.ValueFrom == nil || e.ValueFrom.ConfigMapKeyRef == nil {
			continue
		}
		r := e.ValueFrom.ConfigMapKeyRef
		if r.Name != niAgentName || !bytes.Contains(initd, []byte("\n  "+r.Key+": ")) {
			t.Errorf("env %s reads ConfigMap %s key %s, which /%s does not write", e.Name, r.Name, r.Key, niServerInitd)
		}
	}
	if !bytes.Contains(initd, []byte("kind: ConfigMap\nmetadata:\n  name: "+niAgentName+"\n  namespace: "+ds.Namespace+"\n")) {
		t.Errorf("/%s does not write ConfigMap %s/%s", niServerInitd, ds.Namespace, niAgentName)
	}

	// Token and CA: files of a projected volume the container mounts.
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("pod automountServiceAccountToken is not false: the agent needs only its audience-bound token")
	}
	mounts := map[string]corev1.VolumeMount{}
	for _, m := range c.VolumeMounts {
		mounts[m.Name] = m
	}
	var tokenPath, caPath string
	for _, v := range spec.Volumes {
		m, mounted := mounts[v.Name]
		if v.Projected == nil || !mounted || m.SubPath != "" {
			continue
		}
		for _, s := range v.Projected.Sources {
			if st := s.ServiceAccountToken; st != nil && st.Audience == niAudience {
				tokenPath = path.Join(m.MountPath, st.Path)
			}
			if cm := s.ConfigMap; cm != nil && cm.Name == "kube-root-ca.crt" {
				for _, it := range cm.Items {
					if it.Key == "ca.crt" {
						caPath = path.Join(m.MountPath, it.Path)
					}
				}
			}
		}
	}
	if tokenPath == "" {
		t.Errorf("no mounted projected serviceAccountToken with audience %s", niAudience)
	} else if args["service-account-token-path"] != tokenPath {
		t.Errorf("--service-account-token-path %q, but the token is projected at %s", args["service-account-token-path"], tokenPath)
	}
	if got := serverDefaults["KONNECTIVITY_AUDIENCE"]; got != niAudience {
		t.Errorf("server KONNECTIVITY_AUDIENCE %q, agent tokens are for %s", got, niAudience)
	}
	// kube-root-ca.crt holds k3s's server CA, which signs the server's certificate.
	if caPath == "" {
		t.Error("no mounted projection of ConfigMap kube-root-ca.crt key ca.crt")
	} else if args["ca-cert"] != caPath {
		t.Errorf("--ca-cert %q, but the CA is projected at %s", args["ca-cert"], caPath)
	}

	// Probes hit the agent's health server.
	port := 8093
	if v, ok := args["health-server-port"]; ok {
		if port, err = strconv.Atoi(v); err != nil {
			t.Errorf("--health-server-port %q: %v", v, err)
		}
	}
	for what, p := range map[string]*corev1.Probe{"liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
		if p == nil || p.HTTPGet == nil {
			t.Errorf("no %s httpGet probe", what)
			continue
		}
		if p.HTTPGet.Port.IntValue() != port {
			t.Errorf("%s probe port %s, health server on %d", what, p.HTTPGet.Port.String(), port)
		}
	}
	// The kubelet must wait for open tunnels to drain before it kills.
	if v, ok := args["drain-timeout"]; ok {
		drain, err := time.ParseDuration(v)
		if err != nil {
			t.Errorf("--drain-timeout %q: %v", v, err)
		}
		grace := int64(corev1.DefaultTerminationGracePeriodSeconds)
		if spec.TerminationGracePeriodSeconds != nil {
			grace = *spec.TerminationGracePeriodSeconds
		}
		if time.Duration(grace)*time.Second <= drain {
			t.Errorf("terminationGracePeriodSeconds %d is not longer than --drain-timeout %s", grace, drain)
		}
	}
	if t.Failed() {
		t.Logf("DaemonSet container: %s", fmt.Sprint(c.Args))
	}
}
