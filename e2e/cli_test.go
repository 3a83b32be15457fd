package e2e

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// runCLI runs the binary (or a symlink to it named name) with args, bounded
// in time, and returns its stdout, stderr and exit code.
func runCLI(t *testing.T, bin string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var out, errb bytes.Buffer
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("%s %s still running after 10s (it started instead of answering):\n%s", bin, strings.Join(args, " "), errb.String())
	}
	code = cmd.ProcessState.ExitCode()
	if err != nil && code < 0 {
		t.Fatalf("%s %s: %v", bin, strings.Join(args, " "), err)
	}
	return out.String(), errb.String(), code
}

// TestCommandLineAnswers: every command under every name answers --version
// with the build it is (version, commit, build date, Go version) and
// starts nothing; a mistyped flag is one line naming it, the flag meant
// and where the flags are listed.
func TestCommandLineAnswers(t *testing.T) {
	binDir := t.TempDir()
	for _, name := range []string{"konnectivity-server", "konnectivity-agent", "proxy-server", "proxy-agent", "eks-konnectivity-cert"} {
		if err := os.Symlink(konnectivityBin, filepath.Join(binDir, name)); err != nil {
			t.Fatal(err)
		}
	}
	want, errOut, code := runCLI(t, konnectivityBin, "version")
	if code != 0 || errOut != "" {
		t.Fatalf("version: exit %d, stderr %q", code, errOut)
	}
	block := regexp.MustCompile(`^konnectivity (\S+)\ncommit:     (\S+)( \(with uncommitted changes\))?\nbuild date: (\S+)\ngo:         (go1\.\S+) linux/\w+\n$`)
	m := block.FindStringSubmatch(want)
	if m == nil {
		t.Fatalf("version printed %q; want the version, commit, build date and Go version, one a line", want)
	}
	// A build that was given the commit and date (make build) prints them.
	if info, err := exec.Command("go", "version", "-m", konnectivityBin).Output(); err == nil {
		if c := regexp.MustCompile(`-X main\.commit=(\S+)`).FindSubmatch(info); c != nil && string(c[1]) != m[2] {
			t.Errorf("version prints commit %q, the binary was built with -X main.commit=%s", m[2], c[1])
		}
		if d := regexp.MustCompile(`-X main\.buildDate=(\S+)`).FindSubmatch(info); d != nil {
			if string(d[1]) != m[4] {
				t.Errorf("version prints build date %q, the binary was built with -X main.buildDate=%s", m[4], d[1])
			}
			if _, err := time.Parse(time.RFC3339, m[4]); err != nil {
				t.Errorf("build date %q is not RFC 3339: %v", m[4], err)
			}
		}
	}
	t.Logf("version:\n%s", want)

	for _, argv := range [][]string{
		{konnectivityBin, "--version"},
		{konnectivityBin, "server", "--version"},
		// Flags that would start a server (and fail on the missing files)
		// with --version last: it answers and starts nothing.
		{filepath.Join(binDir, "konnectivity-server"), "--mode=http-connect", "--uds-name=" + filepath.Join(binDir, "s.sock"),
			"--cluster-cert=/nonexistent/c", "--cluster-key=/nonexistent/k", "--version"},
		{filepath.Join(binDir, "proxy-server"), "--version"},
		{filepath.Join(binDir, "konnectivity-agent"), "--version"},
		{filepath.Join(binDir, "proxy-agent"), "--version"},
		{filepath.Join(binDir, "eks-konnectivity-cert"), "--version"},
		{konnectivityBin, "status", "--version"},
		{konnectivityBin, "demo", "--version"},
	} {
		out, errOut, code := runCLI(t, argv[0], argv[1:]...)
		if code != 0 || out != want || errOut != "" {
			t.Errorf("%s %s: exit %d, stdout %q, stderr %q; want exit 0 and the version block", filepath.Base(argv[0]), strings.Join(argv[1:], " "), code, out, errOut)
		}
	}
	if _, err := os.Lstat(filepath.Join(binDir, "s.sock")); err == nil {
		t.Error("konnectivity-server --version made its socket: the server started")
	}

	for _, c := range []struct {
		argv []string
		want string
	}{
		{[]string{filepath.Join(binDir, "konnectivity-server"), "--mode=http-connect", "--agent-prot=8132"},
			"konnectivity server: unknown flag --agent-prot (did you mean --agent-port?); 'konnectivity server --help' lists the flags\n"},
		{[]string{filepath.Join(binDir, "proxy-agent"), "--proxy-server-hots=x"},
			"konnectivity agent: unknown flag --proxy-server-hots (did you mean --proxy-server-host?); 'konnectivity agent --help' lists the flags\n"},
	} {
		out, errOut, code := runCLI(t, c.argv[0], c.argv[1:]...)
		if code != 2 || errOut != c.want || out != "" {
			t.Errorf("%s %s: exit %d, %d lines on stderr:\n%s\nwant exit 2 and the one line %q", filepath.Base(c.argv[0]), strings.Join(c.argv[1:], " "),
				code, strings.Count(errOut, "\n"), tail(errOut, 400), c.want)
		}
	}
}
