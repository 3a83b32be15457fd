package main

import (
	"bytes"
	"context"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

// TestMain lets the test binary serve as the benchmark's helper processes,
// which are this executable run again with helperEnv set.
func TestMain(m *testing.M) {
	if role := os.Getenv(helperEnv); role != "" {
		os.Exit(runHelper(role))
	}
	os.Exit(m.Run())
}

// TestScaleSmoke runs the scale benchmark at a tiny size against
// $KONNECTIVITY_BIN (or a binary built from ../.. as `make build` does), both
// front doors with the product's agents, and the gRPC door with agents
// speaking upstream's protocol (the --other path), so that it cannot rot. It fails on correctness only (an
// agent not connected, a dial or a held tunnel that failed, a tunnel left
// open), never on a figure.
func TestScaleSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a server and helper processes; skipped with -short")
	}
	bin := benchproc.Binary(t)
	t.Run("product agents", func(t *testing.T) {
		// A small budget per helper: several simulators and echo processes.
		out := runSmoke(t, bin, "--agents", "20", "--tunnels", "200", "--fds-per-helper", "150")
		for _, want := range []string{"| figure | http-connect | grpc |", "server RSS per agent", "server RSS per idle tunnel", "dial p50 / p99, 20 agents + tunnels held"} {
			if !strings.Contains(out, want) {
				t.Errorf("table lacks %q", want)
			}
		}
		if !strings.Contains(out, "| agent simulators: processes; goroutines, RSS with agents / + tunnels | 2;") {
			t.Errorf("not 2 simulator processes for 220 sockets at 150 each")
		}
	})
	t.Run("upstream-protocol agents", func(t *testing.T) {
		out := runSmoke(t, bin, "--agents", "10", "--tunnels", "100", "--doors", "grpc", "--agent-protocol", "upstream")
		if !strings.Contains(out, "| figure | grpc (upstream-protocol agents) |") {
			t.Errorf("table lacks the upstream-protocol column")
		}
	})
}

// runSmoke runs the benchmark with args beside --bin and small bounds, fails
// t on any failed check or unmeasured figure, and returns the output.
func runSmoke(t *testing.T, bin string, args ...string) string {
	t.Helper()
	var stderr bytes.Buffer
	cfg, err := parseFlags(append([]string{"--bin", bin, "--dials", "50", "--idle-cpu", "500ms", "--after-burst", "500ms",
		"--connect-timeout", "30s", "--timeout", "2m"}, args...), &stderr)
	if err != nil {
		t.Fatalf("parse flags: %v\n%s", err, stderr.String())
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.timeout+time.Minute)
	defer cancel()
	base := runtime.NumGoroutine()
	var out, progress bytes.Buffer
	res, err := run(ctx, cfg, &out, &progress)
	// Every goroutine the run started ends with it (gRPC connections and
	// idle HTTP connections finish closing just after).
	var left int
	if !waitFor(ctx, 10*time.Second, func() bool { left = runtime.NumGoroutine(); return left <= base }) {
		t.Errorf("%d goroutines after the run, %d before", left, base)
	}
	t.Logf("progress:\n%s\n%s", progress.String(), out.String())
	if err != nil {
		t.Fatalf("scale: %v", err)
	}
	if res.failed > 0 || res.passed == 0 {
		t.Fatalf("scale: %d checks passed, %d failed", res.passed, res.failed)
	}
	if strings.Contains(out.String(), "| – |") {
		t.Errorf("a figure was not measured:\n%s", out.String())
	}
	return out.String()
}

// TestShortErr: error kinds lose their addresses, nothing else.
func TestShortErr(t *testing.T) {
	for in, want := range map[string]string{
		"TLS handshake with 127.0.0.1:4000: EOF":                                    "TLS handshake with ADDR: EOF",
		"read tcp 127.0.0.1:45440->127.0.0.1:37519: read: connection reset by peer": "read tcp ADDR->ADDR: read: connection reset by peer",
		"server refused": "server refused",
	} {
		if got := shortErr(in); got != want {
			t.Errorf("shortErr(%q) = %q, want %q", in, got, want)
		}
	}
}
