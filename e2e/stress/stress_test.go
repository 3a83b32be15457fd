package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

// TestStressSmall is bench-stress's small form: 500 tunnels each moving
// 1 MiB at once, every shape, beside a CPU hog, against
// $KONNECTIVITY_BIN (or a binary built from ../.. as `make build` does). It
// fails only when a tunnel does not complete or a byte is wrong, never on
// timing: the figures are printed, not asserted.
func TestStressSmall(t *testing.T) {
	runSmall(t, "--shapes", "echo,download,upload", "--hogs", "1", "--hog-for", "10s", "--destinations", "loopback")
}

// TestStressPodNetwork runs the small form's one-way shapes with the
// destinations where pods are, in a network namespace behind a veth: the
// path whose sockets the agent sizes by a 1448-byte segment. It needs
// root, as the namespace does.
func TestStressPodNetwork(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("a network namespace needs root")
	}
	out := runSmall(t, "--shapes", "download,upload", "--destinations", "pod")
	if !strings.Contains(out, "destinations on pod") {
		t.Fatal("the run did not say where its destinations were")
	}
}

// runSmall runs 500 tunnels of 1 MiB each with args against
// $KONNECTIVITY_BIN (or a binary built from ../.. as `make build` does),
// and returns what it printed. It fails only when a tunnel does not
// complete or a byte is wrong, never on timing.
func runSmall(t *testing.T, args ...string) string {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a server and an agent; skipped with -short")
	}
	bin := benchproc.Binary(t)
	var stderr bytes.Buffer
	cfg, err := parseFlags(append([]string{"--bin", bin, "--tunnels", "500", "--bytes", "1048576", "--timeout", "3m"}, args...), &stderr)
	if err != nil {
		t.Fatalf("parse flags: %v\n%s", err, stderr.String())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var out bytes.Buffer
	ok, err := run(ctx, cfg, &out)
	t.Logf("\n%s", out.String())
	if err != nil {
		t.Fatalf("stress: %v", err)
	}
	if !ok {
		t.Fatal("stress: a tunnel did not complete, or a byte was wrong")
	}
	return out.String()
}

func TestParseFlags(t *testing.T) {
	var stderr bytes.Buffer
	for _, args := range [][]string{
		{},                               // no --bin
		{"--bin", "x", "--tunnels", "0"}, // nothing to do
		{"--bin", "x", "--shapes", "echo,sideways"}, // no such shape
		{"--bin", "x", "--destinations", "moon"},    // no such place
	} {
		if _, err := parseFlags(args, &stderr); err == nil {
			t.Errorf("parseFlags(%q): no error", args)
		}
	}
	cfg, err := parseFlags([]string{"--bin", "x", "--shapes", "download, upload"}, &stderr)
	if err != nil || len(cfg.shapes) != 2 || cfg.shapes[0] != download || cfg.shapes[1] != upload {
		t.Errorf("parseFlags: %+v, %v", cfg.shapes, err)
	}
}

func TestPatternCatchesMisplacedBytes(t *testing.T) {
	p := newPattern()
	a, b := offsetOf(1), offsetOf(2)
	chunk := append([]byte(nil), p.slice(a, 1000, 5000)...)
	if !p.check(a, 1000, chunk) {
		t.Fatal("the right bytes failed the check")
	}
	if p.check(b, 1000, chunk) {
		t.Error("another tunnel's bytes passed the check")
	}
	if p.check(a, 1001, chunk) {
		t.Error("bytes out of place passed the check")
	}
	long := make([]byte, 0, 3*patternLen)
	for pos := int64(0); pos < 3*patternLen; pos += writeSize {
		long = append(long, p.slice(a, pos, int(min(writeSize, 3*patternLen-pos)))...)
	}
	if !p.check(a, 0, long) {
		t.Error("a run longer than the pattern failed the check")
	}
}
