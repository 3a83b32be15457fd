package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

const (
	// upstreamModuleDir is the nested module that pins upstream's agent.
	upstreamModuleDir = "upstream"
	upstreamAgentPkg  = "sigs.k8s.io/apiserver-network-proxy/cmd/agent"
	// upstreamBuildTimeout bounds a cold build on a loaded 2-core machine.
	upstreamBuildTimeout = 20 * time.Minute
)

var upstreamAgentOnce struct {
	sync.Once
	path string
	err  string
}

// upstreamAgentBin builds upstream's proxy-agent (v0.36.0, e2e/upstream)
// once per run into the cache directory the kube binaries use; the Go
// build cache makes later builds a link at most. Only the Go module proxy
// is needed.
func upstreamAgentBin(t *testing.T) string {
	t.Helper()
	upstreamAgentOnce.Do(func() {
		cache, err := os.UserCacheDir()
		if err != nil {
			cache = os.TempDir()
		}
		dir := filepath.Join(cache, "konnectivity-e2e-kube")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			upstreamAgentOnce.err = err.Error()
			return
		}
		out := filepath.Join(dir, "proxy-agent-v0.36.0")
		ctx, cancel := context.WithTimeout(context.Background(), upstreamBuildTimeout)
		defer cancel()
		start := time.Now()
		cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", out, upstreamAgentPkg)
		cmd.Dir = upstreamModuleDir
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			upstreamAgentOnce.err = "go build " + upstreamAgentPkg + " (in e2e/" + upstreamModuleDir + "): " + err.Error() + "\n" + string(b)
			return
		}
		t.Logf("built upstream's proxy-agent in %v", time.Since(start).Round(100*time.Millisecond))
		upstreamAgentOnce.path = out
	})
	if upstreamAgentOnce.err != "" {
		t.Fatal(upstreamAgentOnce.err)
	}
	return upstreamAgentOnce.path
}
