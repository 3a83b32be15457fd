package daemon

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestNewLoggerThresholds: with --logtostderr=false the file gets every
// line and stderr only those at or above the threshold; with
// --logtostderr=true and no legacy behaviour, the threshold filters stderr.
// Settings read differently from klog are reported through warn.
func TestNewLoggerThresholds(t *testing.T) {
	file := filepath.Join(t.TempDir(), "k.log")
	var stderr bytes.Buffer
	var warns []string
	warn := func(msg string, _ ...any) { warns = append(warns, msg) }
	log, err := NewLogger(LogSettings{Format: "json", File: file, StderrThreshold: SeverityWarning, FileMaxSize: 5, FileMaxSizeSet: true}, &stderr, warn)
	if err != nil {
		t.Fatal(err)
	}
	log.Info("an info line")
	log.Warn("a warn line")
	b, _ := os.ReadFile(file)
	if !strings.Contains(string(b), "an info line") || !strings.Contains(string(b), "a warn line") {
		t.Errorf("file lacks a line:\n%s", b)
	}
	if strings.Contains(stderr.String(), "an info line") || !strings.Contains(stderr.String(), "a warn line") {
		t.Errorf("stderr holds the wrong lines:\n%s", stderr.String())
	}
	if len(warns) != 1 || !strings.Contains(warns[0], "--log-file-max-size is not honoured") {
		t.Errorf("warnings %q, want one about --log-file-max-size", warns)
	}

	stderr.Reset()
	log, err = NewLogger(LogSettings{Format: "text", ToStderr: true, StderrThreshold: SeverityError}, &stderr, warn)
	if err != nil {
		t.Fatal(err)
	}
	log.Warn("a warn line")
	log.Error("an error line")
	if strings.Contains(stderr.String(), "a warn line") || !strings.Contains(stderr.String(), "an error line") {
		t.Errorf("stderr holds the wrong lines:\n%s", stderr.String())
	}

	if _, err := NewLogger(LogSettings{Format: "xml", ToStderr: true, LegacyThreshold: true}, &stderr, warn); err == nil || !strings.Contains(err.Error(), "want text or json") {
		t.Errorf("--log-format=xml: err %v", err)
	}
}

// TestSeverityFlag: klog's names in any case and its numbers are read;
// anything else is refused.
func TestSeverityFlag(t *testing.T) {
	for v, want := range map[string]Severity{"info": SeverityInfo, "WARNING": SeverityWarning, "2": SeverityError, "Fatal": SeverityFatal} {
		var s Severity
		if err := s.Set(v); err != nil || s != want {
			t.Errorf("Set(%q) = %v, %v; want %v", v, s.String(), err, want.String())
		}
	}
	var s Severity
	if err := s.Set("LOUD"); err == nil {
		t.Error("Set(LOUD) accepted")
	}
}
