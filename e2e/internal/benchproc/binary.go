package benchproc

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// Binary is the konnectivity binary a benchmark's smoke test runs:
// $KONNECTIVITY_BIN, or one built from the repository's root (two levels
// up from the test's package, as `make build` builds it) into the test's
// temporary directory.
func Binary(t testing.TB) string {
	t.Helper()
	if bin := os.Getenv("KONNECTIVITY_BIN"); bin != "" {
		return bin
	}
	bin := filepath.Join(t.TempDir(), "konnectivity")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, ".")
	cmd.Dir = filepath.Join("..", "..")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build konnectivity from ../..: %v\n%s", err, out)
	}
	return bin
}
