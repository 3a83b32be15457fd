package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestAgentTunnelCapFromDescriptors: an agent with a descriptor limit of
// 320 carries (320 - 256) / 2 = 32 tunnels from its one server, its whole
// budget, and refuses the next naming --max-streams-total, in words
// kube-apiserver's error shows (the server passes the agent's 503 on as a
// 502 whose status line carries it).
func TestAgentTunnelCapFromDescriptors(t *testing.T) {
	if _, err := os.Stat("/usr/bin/prlimit"); err != nil {
		t.Skip("prlimit not installed")
	}
	const limit, budget = 320, (320 - 256) / 2
	wrapper := filepath.Join(t.TempDir(), "konnectivity-nofile")
	script := fmt.Sprintf("#!/bin/sh\nexec prlimit --nofile=%d:%d %s \"$@\"\n", limit, limit, konnectivityBin)
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	s := startServer(t)
	a := s.launchAgentFrom(t, wrapper, nil, s.pki, "a1", "")
	waitHTTP(t, a.proc, a.healthURL("/readyz"), 200)
	if got := nofileLimit(t, a.proc.cmd.Process.Pid); got != limit {
		t.Fatalf("agent's descriptor limit %d, want %d", got, limit)
	}
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	for range budget {
		openEcho(t, s, echo) // held open until the test ends
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := s.egressDialer(t).bounded()(ctx, "tcp", echo.addr())
	if err == nil {
		c.Close()
		t.Fatalf("tunnel %d opened past the agent's budget of %d", budget+1, budget)
	}
	t.Logf("tunnel %d: %v", budget+1, err)
	want := fmt.Sprintf("%d in all (--max-streams-total", budget)
	if !strings.Contains(err.Error(), want) {
		t.Errorf("tunnel past the budget refused with %v; want kube-apiserver's error to say %q", err, want)
	}
}
