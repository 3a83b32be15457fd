package e2e

// The e2e-cluster test's own images: one static binary (e2e/internal/clusterpod)
// in a one-layer OCI archive per role, imported into containerd with
// `ctr images import` as the agent image is: no registry is reached.

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// clusterPodBinary builds e2e/internal/clusterpod as a static binary.
func clusterPodBinary(t *testing.T, dir string) string {
	t.Helper()
	out := filepath.Join(dir, "clusterpod")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, "./internal/clusterpod")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./internal/clusterpod: %v\n%s", err, b)
	}
	return out
}

// writeClusterImage writes an OCI image archive named name (a full
// reference, docker.io/...) holding binary as /clusterpod, run as
// entrypoint.
func writeClusterImage(t *testing.T, path, name string, binary []byte, entrypoint []string) {
	t.Helper()
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	mtime := time.Unix(0, 0)
	if err := tw.WriteHeader(&tar.Header{Name: "clusterpod", Mode: 0o755, Size: int64(len(binary)), ModTime: mtime, Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	if _, err := tw.Write(binary); err != nil {
		t.Fatal(err)
	}
	// Directories the CRI and the kubelet mount onto.
	for _, d := range []string{"tmp/", "tls/", "dev/", "proc/", "sys/", "etc/"} {
		if err := tw.WriteHeader(&tar.Header{Name: d, Mode: 0o755, ModTime: mtime, Typeflag: tar.TypeDir}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	if _, err := zw.Write(layer.Bytes()); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	digest := func(b []byte) string {
		s := sha256.Sum256(b)
		return "sha256:" + hex.EncodeToString(s[:])
	}
	config, err := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"config": map[string]any{"Entrypoint": entrypoint},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{digest(layer.Bytes())}},
	})
	if err != nil {
		t.Fatal(err)
	}
	desc := func(mediaType string, b []byte) map[string]any {
		return map[string]any{"mediaType": mediaType, "digest": digest(b), "size": len(b)}
	}
	manifest, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        desc("application/vnd.oci.image.config.v1+json", config),
		"layers":        []any{desc("application/vnd.oci.image.layer.v1.tar+gzip", gz.Bytes())},
	})
	if err != nil {
		t.Fatal(err)
	}
	md := desc("application/vnd.oci.image.manifest.v1+json", manifest)
	md["annotations"] = map[string]string{"io.containerd.image.name": name}
	index, err := json.Marshal(map[string]any{"schemaVersion": 2, "manifests": []any{md}})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	aw := tar.NewWriter(&out)
	add := func(name string, b []byte) {
		if err := aw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), ModTime: mtime, Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := aw.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	add("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`))
	add("index.json", index)
	for _, b := range [][]byte{config, gz.Bytes(), manifest} {
		add("blobs/sha256/"+digest(b)[len("sha256:"):], b)
	}
	if err := aw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, out.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}
