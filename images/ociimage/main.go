package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"debug/elf"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Media types and annotation keys, from the OCI image specification and
// containerd.
const (
	mediaTypeIndex    = "application/vnd.oci.image.index.v1+json"
	mediaTypeManifest = "application/vnd.oci.image.manifest.v1+json"
	mediaTypeConfig   = "application/vnd.oci.image.config.v1+json"
	mediaTypeLayer    = "application/vnd.oci.image.layer.v1.tar+gzip"

	annotationRefName   = "org.opencontainers.image.ref.name"
	annotationImageName = "io.containerd.image.name"

	defaultSource = "https://github.com/spinifex/konnectivity"
	// The user of distroless images: not root, and numeric so that the
	// kubelet can enforce runAsNonRoot without a passwd lookup.
	defaultUser = "65532:65532"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "ociimage:", err)
		if errors.Is(err, flag.ErrHelp) || errors.Is(err, errUsage) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}

var errUsage = errors.New("usage")

// options are the inputs of one image; equal options and binary give equal
// archive bytes.
type options struct {
	ref      reference
	version  string
	revision string
	source   string
	arch     string
	user     string
	created  time.Time
}

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("ociimage", flag.ContinueOnError)
	fs.SetOutput(stderr)
	bin := fs.String("bin", "", "static konnectivity binary to put in the image (required)")
	tag := fs.String("tag", "", "image name with tag, e.g. spinifex/konnectivity-agent:v1.2.3 (required)")
	version := fs.String("version", "", "org.opencontainers.image.version label (required)")
	revision := fs.String("revision", "", "org.opencontainers.image.revision label (required)")
	source := fs.String("source", defaultSource, "org.opencontainers.image.source label")
	arch := fs.String("arch", "", "image architecture (GOARCH name); default: read from the binary's ELF header")
	user := fs.String("user", defaultUser, "numeric uid:gid the container runs as")
	out := fs.String("out", "", "archive to write (required)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 0 || *bin == "" || *tag == "" || *version == "" || *revision == "" || *out == "" {
		fs.Usage()
		return fmt.Errorf("%w: -bin, -tag, -version, -revision and -out are required, and nothing else", errUsage)
	}

	ref, err := parseReference(*tag)
	if err != nil {
		return err
	}
	created, err := sourceDateEpoch(os.Getenv("SOURCE_DATE_EPOCH"))
	if err != nil {
		return err
	}
	if _, _, err := parseUser(*user); err != nil {
		return err
	}
	binArch, err := staticELFArch(*bin)
	if err != nil {
		return err
	}
	if *arch == "" {
		*arch = binArch
	} else if *arch != binArch {
		return fmt.Errorf("-arch %s does not match %s, which is built for %s", *arch, *bin, binArch)
	}
	binary, err := os.ReadFile(*bin)
	if err != nil {
		return fmt.Errorf("read binary: %w", err)
	}

	opts := options{ref: ref, version: *version, revision: *revision, source: *source,
		arch: *arch, user: *user, created: created}
	archive, manifestDigest, err := buildArchive(opts, binary)
	if err != nil {
		return err
	}
	if err := writeFileAtomic(*out, archive); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s (%d bytes): %s %s/%s manifest %s\n",
		*out, len(archive), ref.full(), "linux", *arch, manifestDigest)
	return nil
}

// reference is an image name split the way containerd normalizes it:
// docker.io/library/alpine:3 for "alpine:3".
type reference struct {
	domain string // e.g. docker.io
	path   string // e.g. spinifex/konnectivity-agent
	tag    string
}

func (r reference) full() string { return r.domain + "/" + r.path + ":" + r.tag }

// familiar is the short form Docker prints and writes into RepoTags.
func (r reference) familiar() string {
	if r.domain != "docker.io" {
		return r.full()
	}
	return strings.TrimPrefix(r.path, "library/") + ":" + r.tag
}

var (
	pathComponentRE = regexp.MustCompile(`^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$`)
	domainRE        = regexp.MustCompile(`^(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?$`)
	tagRE           = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)
)

// parseReference accepts NAME:TAG in the distribution reference grammar and
// requires the tag: the DaemonSet pins this exact tag, so "latest" by
// omission would be a mistake. Digests are refused (the digest is ours to
// compute, not to be given).
func parseReference(s string) (reference, error) {
	if strings.Contains(s, "@") {
		return reference{}, fmt.Errorf("image name %q: a digest cannot be given", s)
	}
	slash := strings.LastIndexByte(s, '/')
	colon := strings.LastIndexByte(s, ':')
	if colon <= slash {
		return reference{}, fmt.Errorf("image name %q has no tag (want NAME:TAG)", s)
	}
	name, tag := s[:colon], s[colon+1:]
	if !tagRE.MatchString(tag) {
		return reference{}, fmt.Errorf("image name %q: invalid tag %q", s, tag)
	}
	r := reference{domain: "docker.io", path: name, tag: tag}
	// As in Docker: the first component is a registry only if it looks like
	// a host (has a dot or a port, or is localhost).
	if i := strings.IndexByte(name, '/'); i >= 0 {
		if first := name[:i]; strings.ContainsAny(first, ".:") || first == "localhost" {
			if !domainRE.MatchString(first) {
				return reference{}, fmt.Errorf("image name %q: invalid registry %q", s, first)
			}
			r.domain, r.path = first, name[i+1:]
		}
	}
	if r.domain == "index.docker.io" {
		r.domain = "docker.io"
	}
	if r.domain == "docker.io" && !strings.Contains(r.path, "/") {
		r.path = "library/" + r.path
	}
	for _, c := range strings.Split(r.path, "/") {
		if !pathComponentRE.MatchString(c) {
			return reference{}, fmt.Errorf("image name %q: invalid path component %q", s, c)
		}
	}
	if len(r.domain)+1+len(r.path) > 255 {
		return reference{}, fmt.Errorf("image name %q is longer than 255 characters", s)
	}
	return r, nil
}

// sourceDateEpoch is the one timestamp of the image (reproducible-builds.org
// convention); unset means the Unix epoch.
func sourceDateEpoch(v string) (time.Time, error) {
	if v == "" {
		return time.Unix(0, 0).UTC(), nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 || n > 1<<33-1 { // ustar mtime is 11 octal digits
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH=%q: want seconds since 1970 (0 to 8589934591)", v)
	}
	return time.Unix(n, 0).UTC(), nil
}

// parseUser accepts only numeric uid:gid, non-root: a name would need the
// passwd lookup the kubelet does not do for runAsNonRoot.
func parseUser(s string) (uid, gid int, err error) {
	u, g, ok := strings.Cut(s, ":")
	if ok {
		uid, err = strconv.Atoi(u)
		if err == nil {
			gid, err = strconv.Atoi(g)
		}
	}
	if !ok || err != nil || uid <= 0 || gid < 0 || uid > 1<<31-1 || gid > 1<<31-1 {
		return 0, 0, fmt.Errorf("-user %q: want numeric UID:GID with UID > 0", s)
	}
	return uid, gid, nil
}

// staticELFArch returns the architecture of a Linux executable and refuses a
// dynamically linked one: the image has no libc or loader.
func staticELFArch(path string) (string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return "", fmt.Errorf("read %s as a Linux executable: %w", path, err)
	}
	defer f.Close()
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return "", fmt.Errorf("%s is not an executable (ELF type %s)", path, f.Type)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return "", fmt.Errorf("%s is dynamically linked; build it with CGO_ENABLED=0", path)
		}
	}
	// GOARCH names, which are the OCI platform names.
	switch {
	case f.Machine == elf.EM_X86_64:
		return "amd64", nil
	case f.Machine == elf.EM_AARCH64:
		return "arm64", nil
	case f.Machine == elf.EM_ARM:
		return "arm", nil
	case f.Machine == elf.EM_386:
		return "386", nil
	case f.Machine == elf.EM_RISCV && f.Class == elf.ELFCLASS64:
		return "riscv64", nil
	case f.Machine == elf.EM_PPC64 && f.ByteOrder == binary.LittleEndian:
		return "ppc64le", nil
	case f.Machine == elf.EM_S390:
		return "s390x", nil
	}
	return "", fmt.Errorf("%s: unsupported machine %s", path, f.Machine)
}

// The JSON documents, with only the fields written. Struct fields marshal in
// declaration order and maps in key order, so the bytes are stable.
type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Platform    *platform         `json:"platform,omitempty"`
}

type platform struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
}

type index struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Manifests     []descriptor `json:"manifests"`
}

type manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	Config        descriptor   `json:"config"`
	Layers        []descriptor `json:"layers"`
}

type imageConfig struct {
	Created      string        `json:"created"`
	Architecture string        `json:"architecture"`
	OS           string        `json:"os"`
	Config       runConfig     `json:"config"`
	RootFS       rootFS        `json:"rootfs"`
	History      []historyItem `json:"history"`
}

type runConfig struct {
	User       string            `json:"User"`
	Env        []string          `json:"Env"`
	Entrypoint []string          `json:"Entrypoint"`
	WorkingDir string            `json:"WorkingDir"`
	Labels     map[string]string `json:"Labels"`
}

type rootFS struct {
	Type    string   `json:"type"`
	DiffIDs []string `json:"diff_ids"`
}

type historyItem struct {
	Created   string `json:"created"`
	CreatedBy string `json:"created_by"`
	Comment   string `json:"comment,omitempty"`
}

type dockerManifest struct {
	Config   string   `json:"Config"`
	RepoTags []string `json:"RepoTags"`
	Layers   []string `json:"Layers"`
}

// entry is one file of a tar archive.
type entry struct {
	name     string // with a trailing slash for directories
	mode     int64
	uid, gid int
	link     string // symlink target
	data     []byte
}

// buildArchive returns the image archive and its manifest digest.
func buildArchive(o options, binary []byte) ([]byte, string, error) {
	uid, gid, err := parseUser(o.user)
	if err != nil {
		return nil, "", err
	}
	layerTar, err := writeTar(layerEntries(binary, uid, gid), o.created)
	if err != nil {
		return nil, "", fmt.Errorf("write layer: %w", err)
	}
	layer, err := gzipBytes(layerTar)
	if err != nil {
		return nil, "", fmt.Errorf("compress layer: %w", err)
	}

	created := o.created.Format(time.RFC3339)
	config, err := json.Marshal(imageConfig{
		Created:      created,
		Architecture: o.arch,
		OS:           "linux",
		Config: runConfig{
			User:       o.user,
			Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			Entrypoint: []string{"/usr/local/bin/konnectivity", "agent"},
			WorkingDir: "/",
			Labels: map[string]string{
				"org.opencontainers.image.title":    "konnectivity-agent",
				"org.opencontainers.image.version":  o.version,
				"org.opencontainers.image.revision": o.revision,
				"org.opencontainers.image.source":   o.source,
			},
		},
		RootFS: rootFS{Type: "layers", DiffIDs: []string{digestOf(layerTar)}},
		History: []historyItem{{Created: created, CreatedBy: "images/ociimage",
			Comment: "konnectivity " + o.version}},
	})
	if err != nil {
		return nil, "", fmt.Errorf("encode config: %w", err)
	}
	mfst, err := json.Marshal(manifest{
		SchemaVersion: 2,
		MediaType:     mediaTypeManifest,
		Config:        blobDescriptor(mediaTypeConfig, config),
		Layers:        []descriptor{blobDescriptor(mediaTypeLayer, layer)},
	})
	if err != nil {
		return nil, "", fmt.Errorf("encode manifest: %w", err)
	}
	mfstDesc := blobDescriptor(mediaTypeManifest, mfst)
	// containerd names the image by io.containerd.image.name (the full,
	// normalized name); ref.name holds only the tag, as containerd's and
	// Docker's exporters write it, so `ctr import --base-name` composes.
	mfstDesc.Annotations = map[string]string{
		annotationImageName: o.ref.full(),
		annotationRefName:   o.ref.tag,
	}
	mfstDesc.Platform = &platform{Architecture: o.arch, OS: "linux"}
	idx, err := json.Marshal(index{SchemaVersion: 2, MediaType: mediaTypeIndex, Manifests: []descriptor{mfstDesc}})
	if err != nil {
		return nil, "", fmt.Errorf("encode index: %w", err)
	}
	docker, err := json.Marshal([]dockerManifest{{
		Config:   blobPath(config),
		RepoTags: []string{o.ref.familiar()},
		Layers:   []string{blobPath(layer)},
	}})
	if err != nil {
		return nil, "", fmt.Errorf("encode manifest.json: %w", err)
	}

	entries := []entry{
		{name: "blobs/", mode: 0o755},
		{name: "blobs/sha256/", mode: 0o755},
		{name: "index.json", mode: 0o644, data: idx},
		{name: "manifest.json", mode: 0o644, data: docker},
		{name: "oci-layout", mode: 0o644, data: []byte(`{"imageLayoutVersion":"1.0.0"}`)},
	}
	for _, b := range [][]byte{config, layer, mfst} {
		entries = append(entries, entry{name: blobPath(b), mode: 0o644, data: b})
	}
	archive, err := writeTar(entries, o.created)
	if err != nil {
		return nil, "", fmt.Errorf("write archive: %w", err)
	}
	return archive, mfstDesc.Digest, nil
}

// layerEntries is the image's file system.
func layerEntries(binary []byte, uid, gid int) []entry {
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/nonexistent:/sbin/nologin\n", uid, gid)
	group := fmt.Sprintf("root:x:0:\nnonroot:x:%d:\n", gid)
	if gid == 0 {
		group = "root:x:0:\n"
	}
	return []entry{
		{name: "etc/", mode: 0o755},
		{name: "etc/group", mode: 0o644, data: []byte(group)},
		{name: "etc/passwd", mode: 0o644, data: []byte(passwd)},
		{name: "usr/", mode: 0o755},
		{name: "usr/local/", mode: 0o755},
		{name: "usr/local/bin/", mode: 0o755},
		{name: "usr/local/bin/konnectivity", mode: 0o755, data: binary},
		{name: "usr/local/bin/konnectivity-agent", mode: 0o777, link: "konnectivity"},
	}
}

// writeTar writes entries sorted by name with fixed metadata: ustar headers
// only, so no PAX access or change times creep in.
func writeTar(entries []entry, mtime time.Time) ([]byte, error) {
	sorted := append([]entry(nil), entries...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].name < sorted[j].name })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range sorted {
		h := &tar.Header{
			Name:    e.name,
			Mode:    e.mode,
			Uid:     e.uid,
			Gid:     e.gid,
			ModTime: mtime,
			Format:  tar.FormatUSTAR,
		}
		switch {
		case strings.HasSuffix(e.name, "/"):
			h.Typeflag = tar.TypeDir
		case e.link != "":
			h.Typeflag = tar.TypeSymlink
			h.Linkname = e.link
		default:
			h.Typeflag = tar.TypeReg
			h.Size = int64(len(e.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, fmt.Errorf("tar header %s: %w", e.name, err)
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, fmt.Errorf("tar data %s: %w", e.name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("close tar: %w", err)
	}
	return buf.Bytes(), nil
}

// gzipBytes compresses with a header that has no name and a zero time, so
// only the content decides the bytes.
func gzipBytes(b []byte) ([]byte, error) {
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if err != nil {
		return nil, err
	}
	if _, err := zw.Write(b); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func blobPath(b []byte) string {
	return "blobs/sha256/" + strings.TrimPrefix(digestOf(b), "sha256:")
}

func blobDescriptor(mediaType string, b []byte) descriptor {
	return descriptor{MediaType: mediaType, Digest: digestOf(b), Size: int64(len(b))}
}

// writeFileAtomic replaces path only once the whole archive is on disk, so a
// failed build never leaves a truncated image for the overlay to pick up.
func writeFileAtomic(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("create output directory: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("create output: %w", err)
	}
	defer os.Remove(tmp.Name()) // after a successful rename this is a no-op error
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", tmp.Name(), err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return fmt.Errorf("chmod %s: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp.Name(), err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("rename to %s: %w", path, err)
	}
	return nil
}
