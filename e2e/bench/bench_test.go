package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

// TestQuickBench runs the benchmark in --quick mode against $KONNECTIVITY_BIN
// (or a binary built from ../.. like `make build` does). It fails only on
// correctness errors — wrong bytes, failed dials, processes that misbehave —
// never on timing: the targets are printed, not asserted.
func TestQuickBench(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a server and an agent; skipped with -short")
	}
	bin := benchproc.Binary(t)
	var stderr bytes.Buffer
	cfg, err := parseFlags([]string{"--bin", bin, "--quick"}, &stderr)
	if err != nil {
		t.Fatalf("parse flags: %v\n%s", err, stderr.String())
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.timeout+time.Minute)
	defer cancel()
	var out, progress bytes.Buffer
	res, err := run(ctx, cfg, &out, &progress)
	t.Logf("progress:\n%s\n%s", progress.String(), out.String())
	if err != nil {
		t.Fatalf("bench: %v", err)
	}
	if res.failed > 0 || res.passed == 0 {
		t.Fatalf("bench: %d passed, %d failed", res.passed, res.failed)
	}
}
