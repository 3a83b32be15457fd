package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"
)

const testVersion = "v0.0.0-ociimage-test"

// konnectivityBin is $KONNECTIVITY_BIN, or konnectivity built from the
// repository root (static, like make build) with testVersion stamped in.
func konnectivityBin(t *testing.T) (path string, stamped bool) {
	t.Helper()
	if p := os.Getenv("KONNECTIVITY_BIN"); p != "" {
		return p, false
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go not on PATH and KONNECTIVITY_BIN unset: cannot build konnectivity")
	}
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("repository root not found: %v", err)
	}
	out := filepath.Join(t.TempDir(), "konnectivity")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, goTool, "build", "-trimpath",
		"-ldflags", "-s -w -X main.version="+testVersion, "-o", out, ".")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build konnectivity: %v\n%s", err, b)
	}
	return out, true
}

// TestAgentImage is the test: two builds give the same bytes, the
// layout is consistent, and the binary in the layer runs.
func TestAgentImage(t *testing.T) {
	t.Setenv("SOURCE_DATE_EPOCH", "")
	bin, stamped := konnectivityBin(t)
	binary, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	var archives [2][]byte
	for i, out := range []string{filepath.Join(dir, "a", "image.tar"), filepath.Join(dir, "b", "image.tar")} {
		var stdout, stderr bytes.Buffer
		err := run([]string{"-bin", bin, "-tag", "spinifex/konnectivity-agent:" + testVersion,
			"-version", testVersion, "-revision", "0123abc", "-out", out}, &stdout, &stderr)
		if err != nil {
			t.Fatalf("build %d: %v\n%s", i+1, err, stderr.String())
		}
		if !strings.Contains(stdout.String(), "docker.io/spinifex/konnectivity-agent:"+testVersion) {
			t.Errorf("build %d output does not name the image: %q", i+1, stdout.String())
		}
		if archives[i], err = os.ReadFile(out); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(archives[0], archives[1]) {
		t.Fatal("two builds from the same inputs differ")
	}

	img := inspect(t, archives[0])
	checkImage(t, img, binary, time.Unix(0, 0))
	if stamped && img.config.Architecture != runtime.GOARCH {
		t.Errorf("architecture %q, want %s (the binary was built for it)", img.config.Architecture, runtime.GOARCH)
	}

	// Run the binary as it is in the layer (not the input file).
	exe := filepath.Join(t.TempDir(), "konnectivity")
	if err := os.WriteFile(exe, img.layer["usr/local/bin/konnectivity"].data, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, exe, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("konnectivity version from the layer: %v\n%s", err, out)
	}
	if !strings.HasPrefix(string(out), "konnectivity ") {
		t.Errorf("konnectivity version printed %q", out)
	}
	if stamped && !strings.Contains(string(out), testVersion) {
		t.Errorf("konnectivity version printed %q, want it to contain %s", out, testVersion)
	}
}

// TestSourceDateEpoch: the one timestamp comes from SOURCE_DATE_EPOCH and is
// used everywhere; nothing else varies.
func TestSourceDateEpoch(t *testing.T) {
	binary := []byte("\x7fELF stand-in")
	at := time.Unix(1700000000, 0).UTC()
	o := testOptions(t)
	o.created = at
	a, _, err := buildArchive(o, binary)
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := buildArchive(o, binary)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, b) {
		t.Fatal("same inputs, different bytes")
	}
	checkImage(t, inspect(t, a), binary, at)
	o.created = time.Unix(0, 0)
	c, _, err := buildArchive(o, binary)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(a, c) {
		t.Fatal("a different SOURCE_DATE_EPOCH gave the same bytes")
	}

	got, err := sourceDateEpoch("1700000000")
	if err != nil || !got.Equal(at) {
		t.Errorf("sourceDateEpoch(1700000000) = %v, %v", got, err)
	}
	for _, bad := range []string{"-1", "x", "1.5", "8589934592"} {
		if _, err := sourceDateEpoch(bad); err == nil {
			t.Errorf("sourceDateEpoch(%q) accepted", bad)
		}
	}
}

// TestUser: the user is a numeric non-root uid:gid in the config and in
// /etc/passwd; root and names are refused.
func TestUser(t *testing.T) {
	o := testOptions(t)
	o.user = "1000:2000"
	a, _, err := buildArchive(o, []byte("bin"))
	if err != nil {
		t.Fatal(err)
	}
	img := inspect(t, a)
	if img.config.Config.User != "1000:2000" {
		t.Errorf("User = %q", img.config.Config.User)
	}
	if p := string(img.layer["etc/passwd"].data); !strings.Contains(p, "\nnonroot:x:1000:2000:") {
		t.Errorf("/etc/passwd has no nonroot 1000:2000 line:\n%s", p)
	}
	if g := string(img.layer["etc/group"].data); !strings.Contains(g, "\nnonroot:x:2000:") {
		t.Errorf("/etc/group has no nonroot 2000 line:\n%s", g)
	}
	for _, bad := range []string{"0:0", "0", "nonroot", "65532", "65532:x", "-1:1", ":1", "1:"} {
		if _, _, err := parseUser(bad); err == nil {
			t.Errorf("parseUser(%q) accepted", bad)
		}
	}
}

func TestRunErrors(t *testing.T) {
	dir := t.TempDir()
	notELF := filepath.Join(dir, "script")
	if err := os.WriteFile(notELF, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	self, _ := konnectivityBin(t) // a static executable
	selfArch, err := staticELFArch(self)
	if err != nil {
		t.Fatal(err)
	}
	otherArch := "arm64"
	if selfArch == otherArch {
		otherArch = "amd64"
	}
	out := filepath.Join(dir, "out.tar")
	base := []string{"-tag", "x/y:1", "-version", "1", "-revision", "r", "-out", out}
	cases := []struct {
		name string
		args []string
		env  string
		want string
	}{
		{"no flags", nil, "", "required"},
		{"no revision", []string{"-bin", self, "-tag", "x/y:1", "-version", "1", "-out", out}, "", "required"},
		{"extra argument", append([]string{"-bin", self, "extra"}, base...), "", "required"},
		{"not ELF", append([]string{"-bin", notELF}, base...), "", "Linux executable"},
		{"missing binary", append([]string{"-bin", filepath.Join(dir, "nope")}, base...), "", "no such file"},
		{"arch mismatch", append([]string{"-bin", self, "-arch", otherArch}, base...), "", "does not match"},
		{"no tag", []string{"-bin", self, "-tag", "x/y", "-version", "1", "-revision", "r", "-out", out}, "", "no tag"},
		{"root user", append([]string{"-bin", self, "-user", "0:0"}, base...), "", "UID > 0"},
		{"bad epoch", append([]string{"-bin", self}, base...), "yesterday", "SOURCE_DATE_EPOCH"},
	}
	// A dynamically linked executable: this test binary (cgo is on by
	// default) or else /bin/sh.
	for _, dyn := range []string{testBinary(t), "/bin/sh"} {
		if _, err := staticELFArch(dyn); err != nil && strings.Contains(err.Error(), "dynamically linked") {
			cases = append(cases, struct {
				name string
				args []string
				env  string
				want string
			}{"dynamic binary", append([]string{"-bin", dyn}, base...), "", "CGO_ENABLED=0"})
			break
		}
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("SOURCE_DATE_EPOCH", c.env)
			var stdout, stderr bytes.Buffer
			err := run(c.args, &stdout, &stderr)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("run = %v, want an error containing %q", err, c.want)
			}
			if _, err := os.Stat(out); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("an archive was written despite the error")
			}
		})
	}
	// Matching -arch is accepted.
	t.Setenv("SOURCE_DATE_EPOCH", "")
	if err := run(append([]string{"-bin", self, "-arch", selfArch}, base...), io.Discard, io.Discard); err != nil {
		t.Fatalf("-arch %s for a %s binary: %v", selfArch, selfArch, err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 2 {
		t.Errorf("want only the script and out.tar in %s (no temp files left), got %v", dir, entries)
	}
}

func testBinary(t *testing.T) string {
	t.Helper()
	p, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestParseReference(t *testing.T) {
	cases := []struct{ in, full, familiar string }{
		{"spinifex/konnectivity-agent:v1", "docker.io/spinifex/konnectivity-agent:v1", "spinifex/konnectivity-agent:v1"},
		{"docker.io/spinifex/konnectivity-agent:v1", "docker.io/spinifex/konnectivity-agent:v1", "spinifex/konnectivity-agent:v1"},
		{"index.docker.io/spinifex/konnectivity-agent:v1", "docker.io/spinifex/konnectivity-agent:v1", "spinifex/konnectivity-agent:v1"},
		{"alpine:3.20", "docker.io/library/alpine:3.20", "alpine:3.20"},
		{"localhost/a:b", "localhost/a:b", "localhost/a:b"},
		{"registry.example:5000/team/img:0e5a12d-dirty", "registry.example:5000/team/img:0e5a12d-dirty", "registry.example:5000/team/img:0e5a12d-dirty"},
		{"a__b/c.d-e:_x", "docker.io/a__b/c.d-e:_x", "a__b/c.d-e:_x"},
	}
	for _, c := range cases {
		r, err := parseReference(c.in)
		if err != nil {
			t.Errorf("parseReference(%q): %v", c.in, err)
			continue
		}
		if r.full() != c.full || r.familiar() != c.familiar {
			t.Errorf("parseReference(%q) = %q, %q; want %q, %q", c.in, r.full(), r.familiar(), c.full, c.familiar)
		}
	}
	for _, bad := range []string{"", "x", "x:", "registry.example:5000/img", "Upper/x:1", "a/b:1@sha256:00",
		"a//b:1", "a/b:-x", "a/b:" + strings.Repeat("x", 129), "a/-b:1", "a/b_:1", "bad_host.example/a:1"} {
		if r, err := parseReference(bad); err == nil {
			t.Errorf("parseReference(%q) accepted: %q", bad, r.full())
		}
	}
}

// FuzzParseReference: whatever is accepted normalizes to a name that parses
// back to itself, in both spellings.
func FuzzParseReference(f *testing.F) {
	for _, s := range []string{"spinifex/konnectivity-agent:v1", "alpine:3", "localhost:5000/a/b:c",
		"docker.io/library/x:y", "a:b:c", "a/b@sha256:1", "x.y/z:1", ":", "/:a"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := parseReference(s)
		if err != nil {
			return
		}
		for _, again := range []string{r.full(), r.familiar()} {
			r2, err := parseReference(again)
			if err != nil {
				t.Fatalf("%q parsed to %q, which fails: %v", s, again, err)
			}
			if r2 != r {
				t.Fatalf("%q parsed to %+v, %q to %+v", s, r, again, r2)
			}
		}
	})
}

func testOptions(t *testing.T) options {
	t.Helper()
	ref, err := parseReference("spinifex/konnectivity-agent:" + testVersion)
	if err != nil {
		t.Fatal(err)
	}
	return options{ref: ref, version: testVersion, revision: "0123abc", source: defaultSource,
		arch: "amd64", user: defaultUser, created: time.Unix(0, 0).UTC()}
}

// file is one tar entry as read back.
type file struct {
	hdr  *tar.Header
	data []byte
}

// image is an archive as read back, every document decoded.
type image struct {
	files    map[string]file
	index    index
	manifest manifest
	config   imageConfig
	docker   []dockerManifest
	layerTar []byte
	layer    map[string]file
}

// readTar reads every entry and checks what makes it reproducible: sorted
// names, owners 0:0 or the image user, one mtime, plain ustar headers.
func readTar(t *testing.T, what string, b []byte) (map[string]file, []string) {
	t.Helper()
	files := map[string]file{}
	var names []string
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatalf("%s: %s: %v", what, h.Name, err)
		}
		if len(h.PAXRecords) != 0 || h.Format&tar.FormatGNU != 0 || !h.AccessTime.IsZero() || !h.ChangeTime.IsZero() {
			t.Errorf("%s: %s: not a plain ustar header (format %v, pax %v)", what, h.Name, h.Format, h.PAXRecords)
		}
		if h.Uname != "" || h.Gname != "" || h.Devmajor != 0 || h.Devminor != 0 {
			t.Errorf("%s: %s: owner names or device numbers set", what, h.Name)
		}
		if _, dup := files[h.Name]; dup {
			t.Errorf("%s: %s twice", what, h.Name)
		}
		files[h.Name] = file{hdr: h, data: data}
		names = append(names, h.Name)
	}
	if !sort.StringsAreSorted(names) {
		t.Errorf("%s: entries not sorted: %v", what, names)
	}
	return files, names
}

func sha256Hex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// blob returns the blob a descriptor points at, checking its digest and size.
func blob(t *testing.T, files map[string]file, d descriptor) []byte {
	t.Helper()
	hexDigest, ok := strings.CutPrefix(d.Digest, "sha256:")
	if !ok || len(hexDigest) != 64 {
		t.Fatalf("descriptor digest %q is not sha256", d.Digest)
	}
	f, ok := files["blobs/sha256/"+hexDigest]
	if !ok {
		t.Fatalf("blob %s (%s) missing", d.Digest, d.MediaType)
	}
	if got := sha256Hex(f.data); got != hexDigest {
		t.Errorf("blob %s has sha256 %s", d.Digest, got)
	}
	if int64(len(f.data)) != d.Size {
		t.Errorf("blob %s: descriptor size %d, blob size %d", d.Digest, d.Size, len(f.data))
	}
	return f.data
}

func decode(t *testing.T, what string, b []byte, v any) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("decode %s: %v\n%s", what, err, b)
	}
}

// inspect walks the archive as an importer does: oci-layout, index.json,
// the manifest, its config and layer, each blob checked against its
// descriptor; the layer's diff_id is checked against its uncompressed bytes.
func inspect(t *testing.T, archive []byte) image {
	t.Helper()
	var img image
	var names []string
	img.files, names = readTar(t, "archive", archive)
	blobs := 0
	for _, n := range names {
		switch {
		case n == "blobs/" || n == "blobs/sha256/":
			if img.files[n].hdr.Typeflag != tar.TypeDir {
				t.Errorf("%s is not a directory", n)
			}
		case strings.HasPrefix(n, "blobs/sha256/"):
			blobs++
		case n == "oci-layout" || n == "index.json" || n == "manifest.json":
		default:
			t.Errorf("unexpected archive entry %s", n)
		}
		if h := img.files[n].hdr; h.Uid != 0 || h.Gid != 0 {
			t.Errorf("archive entry %s owned by %d:%d", n, h.Uid, h.Gid)
		}
	}
	if blobs != 3 {
		t.Errorf("%d blobs, want 3 (manifest, config, layer)", blobs)
	}
	var layout struct {
		ImageLayoutVersion string `json:"imageLayoutVersion"`
	}
	decode(t, "oci-layout", img.files["oci-layout"].data, &layout)
	if layout.ImageLayoutVersion != "1.0.0" {
		t.Errorf("imageLayoutVersion %q", layout.ImageLayoutVersion)
	}

	decode(t, "index.json", img.files["index.json"].data, &img.index)
	if img.index.SchemaVersion != 2 || img.index.MediaType != mediaTypeIndex || len(img.index.Manifests) != 1 {
		t.Fatalf("index.json: %+v", img.index)
	}
	md := img.index.Manifests[0]
	if md.MediaType != mediaTypeManifest {
		t.Errorf("index manifest media type %q", md.MediaType)
	}
	decode(t, "manifest", blob(t, img.files, md), &img.manifest)
	if img.manifest.SchemaVersion != 2 || img.manifest.MediaType != mediaTypeManifest ||
		img.manifest.Config.MediaType != mediaTypeConfig || len(img.manifest.Layers) != 1 ||
		img.manifest.Layers[0].MediaType != mediaTypeLayer {
		t.Fatalf("manifest: %+v", img.manifest)
	}
	decode(t, "config", blob(t, img.files, img.manifest.Config), &img.config)
	gz := blob(t, img.files, img.manifest.Layers[0])
	// gzip header: magic, deflate, no flags (no name), mtime 0.
	if len(gz) < 10 || !bytes.Equal(gz[:8], []byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0}) {
		t.Errorf("layer gzip header % x, want no name and no time", gz[:min(len(gz), 10)])
	}
	zr, err := gzip.NewReader(bytes.NewReader(gz))
	if err != nil {
		t.Fatalf("layer: %v", err)
	}
	if img.layerTar, err = io.ReadAll(zr); err != nil {
		t.Fatalf("layer: %v", err)
	}
	if want := []string{"sha256:" + sha256Hex(img.layerTar)}; !reflect.DeepEqual(img.config.RootFS.DiffIDs, want) ||
		img.config.RootFS.Type != "layers" {
		t.Errorf("rootfs %+v, want layers %v", img.config.RootFS, want)
	}
	img.layer, _ = readTar(t, "layer", img.layerTar)

	decode(t, "manifest.json", img.files["manifest.json"].data, &img.docker)
	if len(img.docker) != 1 {
		t.Fatalf("manifest.json: %+v", img.docker)
	}
	d := img.docker[0]
	wantCfg := "blobs/sha256/" + strings.TrimPrefix(img.manifest.Config.Digest, "sha256:")
	wantLayer := "blobs/sha256/" + strings.TrimPrefix(img.manifest.Layers[0].Digest, "sha256:")
	if d.Config != wantCfg || !reflect.DeepEqual(d.Layers, []string{wantLayer}) {
		t.Errorf("manifest.json %+v does not point at the config %s and layer %s", d, wantCfg, wantLayer)
	}
	return img
}

// checkImage checks the image's run configuration and file system.
func checkImage(t *testing.T, img image, binary []byte, created time.Time) {
	t.Helper()
	name := "docker.io/spinifex/konnectivity-agent:" + testVersion
	md := img.index.Manifests[0]
	if want := map[string]string{annotationImageName: name, annotationRefName: testVersion}; !reflect.DeepEqual(md.Annotations, want) {
		t.Errorf("index annotations %v, want %v", md.Annotations, want)
	}
	if md.Platform == nil || md.Platform.OS != "linux" || md.Platform.Architecture != img.config.Architecture {
		t.Errorf("index platform %+v, config architecture %q", md.Platform, img.config.Architecture)
	}
	if got := img.docker[0].RepoTags; !reflect.DeepEqual(got, []string{"spinifex/konnectivity-agent:" + testVersion}) {
		t.Errorf("manifest.json RepoTags %v", got)
	}

	c := img.config
	if c.OS != "linux" || c.Architecture == "" {
		t.Errorf("config platform %s/%s", c.OS, c.Architecture)
	}
	wantTime := created.UTC().Format(time.RFC3339)
	if c.Created != wantTime || len(c.History) != 1 || c.History[0].Created != wantTime {
		t.Errorf("config created %q, history %+v; want %s", c.Created, c.History, wantTime)
	}
	if want := []string{"/usr/local/bin/konnectivity", "agent"}; !reflect.DeepEqual(c.Config.Entrypoint, want) {
		t.Errorf("Entrypoint %q, want %q", c.Config.Entrypoint, want)
	}
	if c.Config.User != "65532:65532" {
		t.Errorf("User %q, want 65532:65532", c.Config.User)
	}
	wantLabels := map[string]string{
		"org.opencontainers.image.title":    "konnectivity-agent",
		"org.opencontainers.image.version":  testVersion,
		"org.opencontainers.image.revision": "0123abc",
		"org.opencontainers.image.source":   "https://github.com/spinifex/konnectivity",
	}
	if !reflect.DeepEqual(c.Config.Labels, wantLabels) {
		t.Errorf("Labels %v, want %v", c.Config.Labels, wantLabels)
	}

	// The file system, entry by entry.
	type want struct {
		typ      byte
		mode     int64
		uid, gid int
		link     string
	}
	wantFS := map[string]want{
		"etc/":                             {tar.TypeDir, 0o755, 0, 0, ""},
		"etc/group":                        {tar.TypeReg, 0o644, 0, 0, ""},
		"etc/passwd":                       {tar.TypeReg, 0o644, 0, 0, ""},
		"usr/":                             {tar.TypeDir, 0o755, 0, 0, ""},
		"usr/local/":                       {tar.TypeDir, 0o755, 0, 0, ""},
		"usr/local/bin/":                   {tar.TypeDir, 0o755, 0, 0, ""},
		"usr/local/bin/konnectivity":       {tar.TypeReg, 0o755, 0, 0, ""},
		"usr/local/bin/konnectivity-agent": {tar.TypeSymlink, 0o777, 0, 0, "konnectivity"},
	}
	for n, f := range img.layer {
		w, ok := wantFS[n]
		if !ok {
			t.Errorf("unexpected layer entry %s", n)
			continue
		}
		h := f.hdr
		if h.Typeflag != w.typ || h.Mode != w.mode || h.Uid != w.uid || h.Gid != w.gid || h.Linkname != w.link {
			t.Errorf("layer %s: type %c mode %o owner %d:%d link %q; want %c %o %d:%d %q",
				n, h.Typeflag, h.Mode, h.Uid, h.Gid, h.Linkname, w.typ, w.mode, w.uid, w.gid, w.link)
		}
		if !h.ModTime.Equal(created) {
			t.Errorf("layer %s dated %v, want %v", n, h.ModTime, created)
		}
	}
	for n := range wantFS {
		if _, ok := img.layer[n]; !ok {
			t.Errorf("layer lacks %s", n)
		}
	}
	for n, f := range img.files {
		if !f.hdr.ModTime.Equal(created) {
			t.Errorf("archive %s dated %v, want %v", n, f.hdr.ModTime, created)
		}
	}
	if !bytes.Equal(img.layer["usr/local/bin/konnectivity"].data, binary) {
		t.Error("usr/local/bin/konnectivity in the layer is not the input binary")
	}
	if p := string(img.layer["etc/passwd"].data); !strings.Contains(p, "\nnonroot:x:65532:65532:") {
		t.Errorf("/etc/passwd lacks the nonroot user:\n%s", p)
	}
}
