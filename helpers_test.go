package main

// Helpers shared by the tests of package main.

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// freePort returns a loopback port below the ephemeral range, never the
// same one twice in this test binary.
func freePort(t *testing.T) string {
	t.Helper()
	for range 1000 {
		port := 20000 + rand.IntN(12000)
		if _, dup := givenPorts.LoadOrStore(port, true); dup {
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		ln.Close()
		return strconv.Itoa(port)
	}
	t.Fatal("no free loopback port found")
	return ""
}

// givenPorts remembers the ports freePort gave out.
var givenPorts sync.Map

func httpStatus(url string) int {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func httpBody(t *testing.T, url string) string {
	t.Helper()
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func httpBackend(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "backend "+r.URL.Path)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String()
}

// parseLogs parses args with fresh flags of cmd ("server" or "agent"), runs
// complete, logs one line at each level and returns stderr and the logger's
// file contents (if --log-file was used).
func parseLogs(t *testing.T, cmd string, args []string) (stderr string, code int) {
	t.Helper()
	var errb bytes.Buffer
	var cf *commandFlags
	var complete func() error
	switch cmd {
	case "server":
		o, f := newServerFlags()
		cf, complete = f, func() error { return o.complete(f) }
	default:
		o, f := newAgentFlags()
		cf, complete = f, func() error { return o.complete(f) }
	}
	log, err := cf.parse(args, &errb)
	if err != nil {
		return errb.String() + err.Error(), 2
	}
	if err := complete(); err != nil {
		return errb.String() + err.Error(), 2
	}
	cf.flushWarnings(log)
	log.Info("an info line")
	log.Warn("a warn line")
	log.Error("an error line")
	return errb.String(), 0
}

func serverArgs(extra ...string) []string {
	return append([]string{"--mode=grpc", "--uds-name=/tmp/x.sock", "--cluster-cert=c", "--cluster-key=k"}, extra...)
}

func warnLines(out string) []string {
	var w []string
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "level=WARN") && !strings.Contains(l, "a warn line") {
			w = append(w, l)
		}
	}
	return w
}

func opensslCmd(t *testing.T, args ...string) string {
	t.Helper()
	bin, err := exec.LookPath("openssl")
	if err != nil {
		t.Fatalf("the openssl command is required by this test (install openssl): %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("openssl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// k3sStyleCA makes a CA the way k3s stores it: SEC1 "EC PRIVATE KEY".
func k3sStyleCA(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	keyFile = filepath.Join(dir, "server-ca.key")
	certFile = filepath.Join(dir, "server-ca.crt")
	conf := filepath.Join(dir, "ca.cnf")
	if err := os.WriteFile(conf, []byte("[req]\ndistinguished_name=dn\nprompt=no\n[dn]\nCN=x\n[ca]\nbasicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	opensslCmd(t, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", keyFile)
	opensslCmd(t, "req", "-x509", "-new", "-config", conf, "-extensions", "ca", "-key", keyFile, "-subj", "/CN=k3s-server-ca", "-days", "3650", "-out", certFile)
	return certFile, keyFile
}

func runCertArgs(args ...string) (code int, stdout, stderr string) {
	var o, e bytes.Buffer
	code = runCert(args, &o, &e)
	return code, o.String(), e.String()
}

// parse parses args and returns a logger built from the logging flags
// (parseArgs, then startLogging), with the warnings so far logged.
func (cf *commandFlags) parse(args []string, stderr io.Writer) (*slog.Logger, error) {
	stray, err := cf.parseArgs(args)
	if err != nil {
		return nil, err
	}
	log, err := cf.startLogging(stray, stderr)
	if err == nil {
		cf.flushWarnings(log)
	}
	return log, err
}
