package daemon

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// checkScript writes an executable that prints line and exits with code,
// as a next image's check would.
func checkScript(t *testing.T, line string, code int) string {
	t.Helper()
	exe := filepath.Join(t.TempDir(), "next")
	script := "#!/bin/sh\necho 'a warning first' >&2\necho '" + line + "' >&2\nexit " + strconv.Itoa(code) + "\n"
	if err := os.WriteFile(exe, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return exe
}

// A check that exits CheckExitCertificate is told apart from one whose
// configuration does not load: the restart is refused for its own reason
// (certificate, not config), and the check's last line says why.
func TestCheckNextCertificate(t *testing.T) {
	const line = "konnectivity check server: --cluster-cert: certificate /x/tls.crt expired at 2020-01-01T00:00:00Z"
	err := checkNext(checkScript(t, line, CheckExitCertificate), []string{"check", "server"})
	if !errors.Is(err, errCertificate) || !strings.HasSuffix(err.Error(), line) {
		t.Errorf("exit %d: %v; want errCertificate ending with the check's line", CheckExitCertificate, err)
	}
	err = checkNext(checkScript(t, "konnectivity check server: --cluster-ca-cert: no PEM", 1), []string{"check", "server"})
	if err == nil || errors.Is(err, errCertificate) || !strings.Contains(err.Error(), "--cluster-ca-cert: no PEM") {
		t.Errorf("exit 1: %v; want a config failure naming the flag", err)
	}
	if err := checkNext(checkScript(t, "configuration loads", 0), []string{"check", "server"}); err != nil {
		t.Errorf("exit 0: %v", err)
	}
}
