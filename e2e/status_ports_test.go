package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestStatusFindsDefaultAdminPorts: on a control-plane node that runs the
// server with the admin port its service, the Kubernetes docs and the
// static pod use (8133) and an agent at its defaults (admin 8094),
// `konnectivity status` without flags shows both, each under the address
// it answered on. The fixed ports live in a network namespace of the
// test's own, so nothing else on the machine can hold them.
func TestStatusFindsDefaultAdminPorts(t *testing.T) {
	if os.Geteuid() != 0 && os.Getenv("CI") == "true" {
		t.Fatalf("needs root for a private network namespace (euid %d); CI must run this test", os.Geteuid())
	}
	ns := newNetns(t, nil, "")
	dir, err := os.MkdirTemp("", "kse2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p := newPKI(t, dir)
	inNS := func(args ...string) []string {
		return append([]string{"netns", "exec", ns.name, konnectivityBin}, args...)
	}
	startProcEnv(t, "ip", "server", nil, inNS("server", "--mode=http-connect",
		"--uds-name="+filepath.Join(dir, "k.sock"), "--agent-bind-address=127.0.0.1", "--agent-port=8132",
		"--cluster-cert="+p.serverCert, "--cluster-key="+p.serverKey, "--cluster-ca-cert="+p.caCert,
		"--health-bind-address=127.0.0.1", "--health-port=8134", "--admin-port=8133", "--server-id=s1")...)
	startProcEnv(t, "ip", "agent", nil, inNS("agent", "--proxy-server-host=127.0.0.1", "--proxy-server-port=8132",
		"--ca-cert="+p.caCert, "--agent-cert="+p.agentCert, "--agent-key="+p.agentKey, "--agent-id=node-1",
		"--health-server-host=127.0.0.1", "--sync-interval=100ms")...)

	wants := []string{"the server on 127.0.0.1:8133:\nserver s1 (server count 1): 1 agent(s)", "the agent on 127.0.0.1:8094:\nagent node-1: connected 1/1 servers"}
	var out string
	deadline := time.Now().Add(startTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		b, _ := exec.CommandContext(ctx, "ip", inNS("status")...).CombinedOutput()
		cancel()
		out = string(b)
		missing := false
		for _, w := range wants {
			missing = missing || !strings.Contains(out, w)
		}
		if !missing {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("konnectivity status (no flags) does not show both the server on 8133 and the agent on 8094 within %v:\n%s", startTimeout, out)
		}
		time.Sleep(pollInterval)
	}
	t.Logf("konnectivity status:\n%s", out)
}
