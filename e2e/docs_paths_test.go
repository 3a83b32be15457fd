package e2e

import (
	"os"
	"path"
	"path/filepath"
	"regexp"
	"testing"
)

// TestDocumentedPathsAgree: every command line the README and docs/ show
// uses the paths the OpenRC server service uses (its defaults), and every
// shipped file names the socket the service makes, so an operator who
// runs a documented command by hand, then the service, finds the same
// certificate and socket.
func TestDocumentedPathsAgree(t *testing.T) {
	initd, err := os.ReadFile("../openrc/konnectivity-server.initd")
	if err != nil {
		t.Fatal(err)
	}
	defaults := niShellDefaults(initd)
	tlsDir, uds := defaults["KONNECTIVITY_TLS_DIR"], defaults["KONNECTIVITY_UDS"]
	if tlsDir == "" || uds == "" {
		t.Fatalf("the server init script has no KONNECTIVITY_TLS_DIR or KONNECTIVITY_UDS default: %q, %q", tlsDir, uds)
	}
	files, _ := filepath.Glob("../docs/*.md")
	files = append(files, "../README.md",
		"../images/eks-node/etc/rancher/k3s/egress-selector-config.yaml",
		"../images/control-plane/egress-selector-configuration.yaml",
		"../images/control-plane/konnectivity-server.yaml")
	// The directory of a certificate a command writes or reads, and the
	// socket path, wherever a file names them.
	certDir := regexp.MustCompile(`(?:-dir |--cluster-(?:cert|key)=|(?:minted|reused) )(/var/lib/konnectivity\S*?)(?:/tls\.(?:crt|key))?[\s:\\]`)
	socket := regexp.MustCompile(`/run/konnectivity/[\w.-]+\.socket`)
	seen := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range certDir.FindAllSubmatch(b, -1) {
			seen++
			if dir := path.Clean(string(m[1])); dir != tlsDir {
				t.Errorf("%s: %q uses %s; the server service uses %s (KONNECTIVITY_TLS_DIR)", f, m[0], dir, tlsDir)
			}
		}
		for _, m := range socket.FindAll(b, -1) {
			seen++
			if string(m) != uds {
				t.Errorf("%s: socket %s; the server service makes %s (KONNECTIVITY_UDS)", f, m, uds)
			}
		}
	}
	if seen < 10 {
		t.Fatalf("found only %d certificate and socket paths in %d files: the patterns no longer match the docs", seen, len(files))
	}
	t.Logf("%d paths in %d files agree with %s and %s", seen, len(files), tlsDir, uds)
}
