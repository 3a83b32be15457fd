package e2e

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// TestReleaseFiles: what a release ships beside the binary. The licence is
// Apache-2.0's text; CHANGELOG.md's newest heading is the version the
// binary reports (the Makefile takes it from there); the migration guide
// names each thing an upstream user changes.
func TestReleaseFiles(t *testing.T) {
	license, err := os.ReadFile("../LICENSE")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(license), "Apache License") || !strings.Contains(string(license), "Version 2.0, January 2004") {
		t.Errorf("LICENSE is not the Apache License 2.0")
	}

	changelog, err := os.ReadFile("../CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^## (v\d+\.\d+\.\d+)\b`).FindSubmatch(changelog)
	if m == nil {
		t.Fatal("CHANGELOG.md has no release heading (## vMAJOR.MINOR.PATCH)")
	}
	out, err := exec.Command(konnectivityBin, "version").CombinedOutput()
	if err != nil {
		t.Fatalf("konnectivity version: %v\n%s", err, out)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	if !strings.HasPrefix(first, "konnectivity "+string(m[1])) {
		t.Errorf("konnectivity version says %q; CHANGELOG.md's newest release is %s", first, m[1])
	}
	for _, want := range []string{"commit:", "build date:", "go:"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("konnectivity version does not say its %s\n%s", strings.TrimSuffix(want, ":"), out)
		}
	}

	guide, err := os.ReadFile("../docs/upstream.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, step := range []string{"`--mode`", "`nodes`", "identity", "`--route-agents`", "metadata"} {
		if !strings.Contains(string(guide), step) {
			t.Errorf("docs/upstream.md's migration does not name %s", step)
		}
	}
}
