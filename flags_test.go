package main

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestKlogOutputFlags: logs never vanish from stderr. klog ignores
// --log-file while --logtostderr is true (its default), and so does this
// binary, with a warning; with --logtostderr=false the file gets every
// line and stderr the errors (--stderrthreshold) or, with
// --alsologtostderr, every line.
func TestKlogOutputFlags(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "k.log")
	readFile := func() string {
		b, _ := os.ReadFile(file)
		os.Remove(file)
		return string(b)
	}
	for _, tc := range []struct {
		name               string
		args               []string
		stderrHas, fileHas []string
		stderrLacks        []string
		warns              []string
	}{
		{
			name:      "upstream kind server: --log-file with --logtostderr=true",
			args:      []string{"--log-file=" + file, "--logtostderr=true", "--log-file-max-size=0"},
			stderrHas: []string{"an info line", "a warn line", "an error line"},
			warns:     []string{"--log-file and --log-dir are ignored while --logtostderr=true"},
		},
		{
			name:        "upstream kubernetes example: --logtostderr=false with --log-file",
			args:        []string{"--log-file=" + file, "--logtostderr=false", "--log-file-max-size=0"},
			fileHas:     []string{"an info line", "a warn line", "an error line"},
			stderrHas:   []string{"an error line"},
			stderrLacks: []string{"an info line", "a warn line"},
		},
		{
			name:        "--stderrthreshold=WARNING",
			args:        []string{"--log-file=" + file, "--logtostderr=false", "--stderrthreshold=WARNING"},
			fileHas:     []string{"an info line"},
			stderrHas:   []string{"a warn line", "an error line"},
			stderrLacks: []string{"an info line"},
		},
		{
			name:      "--alsologtostderr",
			args:      []string{"--log_file=" + file, "--logtostderr=false", "--alsologtostderr"},
			fileHas:   []string{"an info line", "an error line"},
			stderrHas: []string{"an info line", "a warn line", "an error line"},
		},
		{
			name:        "--alsologtostderrthreshold=ERROR",
			args:        []string{"--log-file=" + file, "--logtostderr=false", "--alsologtostderr", "--alsologtostderrthreshold=ERROR"},
			fileHas:     []string{"an info line"},
			stderrHas:   []string{"an error line"},
			stderrLacks: []string{"an info line", "a warn line"},
		},
		{
			name:        "--legacy-stderr-threshold-behavior=false",
			args:        []string{"--legacy-stderr-threshold-behavior=false", "--stderrthreshold=ERROR"},
			stderrHas:   []string{"an error line"},
			stderrLacks: []string{"an info line"},
		},
		{
			name:      "--logtostderr=false without a file",
			args:      []string{"--logtostderr=false"},
			stderrHas: []string{"an info line"},
			warns:     []string{"--logtostderr=false without --log-file"},
		},
		{
			name:      "--log-file-max-size not honoured",
			args:      []string{"--log-file=" + file, "--logtostderr=false", "--log-file-max-size=100"},
			fileHas:   []string{"an info line", "--log-file-max-size is not honoured"},
			stderrHas: []string{"an error line"},
			warns:     []string{"--log-file-max-size is not honoured"},
		},
		{
			name:      "klog flags accepted: hyphen and underscore forms",
			args:      []string{"--log-backtrace-at=x.go:1", "--log_backtrace_at=y.go:2", "--add_dir_header", "--one-output=true", "--skip-headers", "--log-flush-frequency=5s", "--vmodule=a=1"},
			stderrHas: []string{"an info line"},
			warns:     []string{"--log-backtrace-at", "--vmodule"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stderr, code := parseLogs(t, "server", serverArgs(tc.args...))
			if code != 0 {
				t.Fatalf("exit %d: %s", code, stderr)
			}
			got := readFile()
			for _, s := range tc.stderrHas {
				if !strings.Contains(stderr, s) {
					t.Errorf("stderr lacks %q:\n%s", s, stderr)
				}
			}
			for _, s := range tc.stderrLacks {
				if strings.Contains(stderr, s) {
					t.Errorf("stderr has %q:\n%s", s, stderr)
				}
			}
			for _, s := range tc.fileHas {
				if !strings.Contains(got, s) {
					t.Errorf("log file lacks %q:\n%s", s, got)
				}
			}
			if len(tc.fileHas) == 0 && got != "" {
				t.Errorf("log file written:\n%s", got)
			}
			w := warnLines(stderr + got)
			if len(w) != len(tc.warns) {
				t.Errorf("warnings %q, want %q", w, tc.warns)
			}
			for _, s := range tc.warns {
				if !strings.Contains(strings.Join(w, "\n"), s) {
					t.Errorf("no warning about %q in %q", s, w)
				}
			}
		})
	}
}

// TestUpstreamValuesWarn: what upstream accepts starts here too, with one
// warning naming what is read differently.
func TestUpstreamValuesWarn(t *testing.T) {
	for _, tc := range []struct {
		cmd   string
		args  []string
		warns []string
	}{
		{"server", serverArgs("--tls-min-version=VersionTLS10"), []string{"tls_min_version=VersionTLS10"}},
		{"server", serverArgs("--tls-min-version=VersionTLS11"), []string{"tls_min_version=VersionTLS11"}},
		{"agent", []string{"--tls-min-version=VersionTLS11"}, []string{"tls_min_version=VersionTLS11"}},
		{"server", serverArgs("--backend-dial-timeout=0"), []string{"--backend-dial-timeout=0 (upstream: no bound) is read as 30s"}},
		{"server", serverArgs("--delete-existing-uds-file", "false"), []string{`positional arguments ignored`, `--delete-existing-uds-file false (a boolean flag takes a value only as --delete-existing-uds-file=false; read as --delete-existing-uds-file=true)`}},
		{"server", serverArgs("stray", "--", "--v=4"), []string{`args="stray --v=4"`}},
		{"agent", []string{"--agent-identifiers=ipv4=${HOST_IP}"}, []string{`identifier="ipv4=${HOST_IP}: an unexpanded variable`}},
		{"agent", []string{"--agent-identifiers=ipv4=&host=n1"}, []string{`identifier="ipv4=: empty value"`}},
		{"agent", []string{"--agent-identifiers=host=localhost&host=node1.mydomain.com&cidr=127.0.0.1/16&ipv4=1.2.3.4&ipv4=5.6.7.8&ipv6=:::::&default-route=true"}, []string{`identifier="ipv6=:::::: not an IP address"`}},
		{"agent", []string{"--agent-identifiers=host=n1&ipv4=10.0.0.5"}, nil},
	} {
		stderr, code := parseLogs(t, tc.cmd, tc.args)
		if code != 0 {
			t.Errorf("%s %v: exit %d: %s", tc.cmd, tc.args, code, stderr)
			continue
		}
		w := warnLines(stderr)
		if len(w) != len(tc.warns) && !(len(tc.warns) == 2 && len(w) == 1) {
			t.Errorf("%s %v: warnings %q, want %q", tc.cmd, tc.args, w, tc.warns)
		}
		for _, s := range tc.warns {
			if !strings.Contains(strings.Join(w, "\n"), s) {
				t.Errorf("%s %v: no warning with %q in:\n%s", tc.cmd, tc.args, s, strings.Join(w, "\n"))
			}
		}
	}
	// What upstream refuses is refused.
	for _, tc := range []struct {
		cmd  string
		args []string
		want string
	}{
		{"agent", []string{"--agent-identifiers=zone=a"}, `unknown identifier "zone"`},
		{"server", serverArgs("--tls-min-version=VersionTLS9"), "want VersionTLS12 or VersionTLS13"},
		{"server", serverArgs("--backend-dial-timeout=-1s"), "want 0 or more"},
		{"server", serverArgs("--stderrthreshold=LOUD"), "want INFO, WARNING, ERROR or FATAL"},
	} {
		stderr, code := parseLogs(t, tc.cmd, tc.args)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%s %v: exit %d, %q; want 2 and %q", tc.cmd, tc.args, code, stderr, tc.want)
		}
	}
	o, cf := newServerFlags()
	if _, err := cf.parse(serverArgs("--backend-dial-timeout=0"), io.Discard); err != nil || o.complete(cf) != nil || o.backendDialTimeout != 30*time.Second {
		t.Errorf("--backend-dial-timeout=0 gives %v", o.backendDialTimeout)
	}
}

// TestStartErrorOnStderr: with every line going to --log-file, a start-up
// error is still on stderr (what kubectl logs shows).
func TestStartErrorOnStderr(t *testing.T) {
	file := filepath.Join(t.TempDir(), "k.log")
	var errb bytes.Buffer
	code := runServer([]string{"--logtostderr=false", "--log-file=" + file, "--mode=nope", "--uds-name=/tmp/x"}, io.Discard, &errb)
	b, _ := os.ReadFile(file)
	if code != 2 || !strings.Contains(errb.String(), `--mode=\"nope\"`) || !strings.Contains(string(b), `--mode=\"nope\"`) {
		t.Errorf("exit %d\nstderr: %s\nfile: %s", code, errb.String(), b)
	}
}
