package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/certs"
)

func TestDispatchByName(t *testing.T) {
	for _, name := range []string{"/usr/local/bin/konnectivity-server", "konnectivity-agent", "eks-konnectivity-cert"} {
		var out, errb bytes.Buffer
		code := dispatch([]string{name, "--help"}, &out, &errb)
		if code != 0 {
			t.Errorf("%s --help: exit %d: %s", name, code, errb.String())
		}
	}
	var out bytes.Buffer
	if code := dispatch([]string{"konnectivity", "version"}, &out, io.Discard); code != 0 || !strings.HasPrefix(out.String(), "konnectivity ") {
		t.Errorf("version: %d %q", code, out.String())
	}
	if code := dispatch([]string{"konnectivity", "frobnicate"}, io.Discard, io.Discard); code != 2 {
		t.Errorf("unknown command: exit %d, want 2", code)
	}
}

// TestMistypedFlagOneLine: a flag that does not exist is one line on
// stderr, naming it, the flag most likely meant and where the flags are
// listed; exit 2, and nothing starts.
func TestMistypedFlagOneLine(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"konnectivity", "server", "--uds-nme=/x"}, "konnectivity server: unknown flag --uds-nme (did you mean --uds-name?); 'konnectivity server --help' lists the flags\n"},
		{[]string{"konnectivity-agent", "--proxy-server-prot=8132"}, "konnectivity agent: unknown flag --proxy-server-prot (did you mean --proxy-server-port?); 'konnectivity agent --help' lists the flags\n"},
		{[]string{"konnectivity", "server", "--no-such-flag"}, "konnectivity server: unknown flag --no-such-flag; 'konnectivity server --help' lists the flags\n"},
		{[]string{"konnectivity", "cert", "-ca-crt=x"}, "konnectivity cert: unknown flag --ca-crt (did you mean --ca-cert?); 'konnectivity cert --help' lists the flags\n"},
		{[]string{"konnectivity", "status", "--admin-adress=x"}, "konnectivity status: unknown flag --admin-adress (did you mean --admin-address?); 'konnectivity status --help' lists the flags\n"},
	}
	for _, c := range cases {
		var out, errb bytes.Buffer
		if code := dispatch(c.args, &out, &errb); code != 2 {
			t.Errorf("%v: exit %d, want 2", c.args, code)
		}
		if errb.String() != c.want || out.Len() != 0 {
			t.Errorf("%v: stderr %q, stdout %q; want stderr %q only", c.args, errb.String(), out.String(), c.want)
		}
	}
}

// TestVersionEverywhere: every command, under each of its names, answers
// --version with the version block on stdout and exits 0 before anything
// starts (the server's flags here would otherwise fail on its missing
// certificate, exit 1).
func TestVersionEverywhere(t *testing.T) {
	var want bytes.Buffer
	writeVersion(&want)
	for _, line := range []string{"konnectivity ", "\ncommit:     ", "\nbuild date: ", "\ngo:         go"} {
		if !strings.Contains(want.String(), line) {
			t.Fatalf("version block %q lacks %q", want.String(), line)
		}
	}
	for _, argv := range [][]string{
		{"konnectivity", "version"},
		{"konnectivity", "--version"},
		{"konnectivity", "server", "--version"},
		{"konnectivity-server", "--mode=http-connect", "--uds-name=/nonexistent/s", "--cluster-cert=/nonexistent/c", "--cluster-key=/nonexistent/k", "--version"},
		{"proxy-agent", "--version"},
		{"konnectivity", "agent", "-version"},
		{"eks-konnectivity-cert", "--version"},
		{"konnectivity", "status", "--version"},
		{"konnectivity", "demo", "--version"},
	} {
		var out, errb bytes.Buffer
		if code := dispatch(argv, &out, &errb); code != 0 || out.String() != want.String() || errb.Len() != 0 {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want 0 and the version block", argv, code, out.String(), errb.String())
		}
	}
}

// Upstream flags that have no effect here are accepted with one warning
// line each, never silently.
func TestCompatFlagsWarn(t *testing.T) {
	_, cf := newServerFlags()
	var logs bytes.Buffer
	_, err := cf.parse([]string{"--xfr-channel-size=150", "--logtostderr=true", "--v", "2", "--uds-name", "/x"}, &logs)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != 1 || !strings.Contains(lines[0], "--xfr-channel-size") || !strings.Contains(lines[0], "WARN") {
		t.Fatalf("want one warning naming --xfr-channel-size, got:\n%s", logs.String())
	}
}

func TestServerFlagValidation(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--mode=http-connect", "--uds-name=/x"}, "--cluster-cert and --cluster-key"},
		{[]string{"--mode=http-connect", "--cluster-cert=c", "--cluster-key=k"}, "TCP frontend (--server-port=8090) needs --server-cert"},
		{[]string{"--mode=http-connect", "--uds-name=/x", "--server-port=0", "--cluster-cert=c", "--cluster-key=k", "--agent-namespace=kube-system"}, "token auth needs all of"},
		{[]string{"--mode=http-connect", "--uds-name=/x", "--cluster-cert=c", "--cluster-key=k", "--proxy-strategies=nearest"}, "unknown proxy strategy"},
		{[]string{"--mode=tcp", "--uds-name=/x"}, "want grpc or http-connect"},
	}
	for _, c := range cases {
		var errb bytes.Buffer
		code := runServer(c.args, io.Discard, &errb)
		if code != 2 || !strings.Contains(errb.String(), c.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", c.args, code, errb.String(), c.want)
		}
	}
}

// The server and agent commands, wired as in production (flags, TLS files,
// health endpoints, socket mode), carry a dial end to end and stop cleanly.
func TestServerAndAgentCommands(t *testing.T) {
	dir := t.TempDir()
	ca, err := certs.NewCA("test", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	caFile := write("ca.crt", ca.CertPEM)
	sc, sk, _ := ca.Issue(certs.Request{CommonName: "server", IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	ac, ak, _ := ca.Issue(certs.Request{CommonName: "agent", Client: true})
	serverCert, serverKey := write("server.crt", sc), write("server.key", sk)
	agentCert, agentKey := write("agent.crt", ac), write("agent.key", ak)
	uds := filepath.Join(dir, "run", "k.sock")
	agentPort, healthPort, agentHealth, adminPort, agentAdmin := freePort(t), freePort(t), freePort(t), freePort(t), freePort(t)

	so, scf := newServerFlags()
	if err := scf.Parse([]string{"--mode=http-connect", "--uds-name=" + uds, "--uds-mode=0660",
		"--agent-port=" + agentPort, "--agent-bind-address=127.0.0.1", "--cluster-cert=" + serverCert, "--cluster-key=" + serverKey,
		"--cluster-ca-cert=" + caFile, "--health-port=" + healthPort, "--health-bind-address=127.0.0.1", "--admin-port=" + adminPort,
		"--graceful-shutdown-timeout=2s"}); err != nil {
		t.Fatal(err)
	}
	if err := so.complete(scf); err != nil {
		t.Fatal(err)
	}
	ao, acf := newAgentFlags()
	if err := acf.Parse([]string{"--proxy-server-host=127.0.0.1", "--proxy-server-port=" + agentPort, "--ca-cert=" + caFile,
		"--agent-cert=" + agentCert, "--agent-key=" + agentKey, "--agent-id=a1", "--health-server-host=127.0.0.1",
		"--health-server-port=" + agentHealth, "--admin-server-port=" + agentAdmin, "--drain-timeout=1s", "--sync-interval=50ms"}); err != nil {
		t.Fatal(err)
	}
	if err := ao.complete(acf); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	wg.Add(1)
	go func() { defer wg.Done(); errs <- so.run(ctx, log) }()
	health := "http://127.0.0.1:" + healthPort + "/readyz"
	// The health port may answer before the front door's socket exists.
	waitFor(t, func() bool {
		_, err := os.Stat(uds)
		return err == nil && httpStatus(health) == http.StatusServiceUnavailable
	})
	fi, err := os.Stat(uds)
	if err != nil {
		t.Fatalf("socket: %v", err)
	}
	if fi.Mode().Perm() != 0o660 {
		t.Fatalf("socket mode %v, want 0660", fi.Mode().Perm())
	}
	agentCtx, stopAgent := context.WithCancel(ctx)
	wg.Add(1)
	go func() { defer wg.Done(); errs <- ao.run(agentCtx, log) }()
	waitFor(t, func() bool { return httpStatus(health) == http.StatusOK })
	waitFor(t, func() bool { return httpStatus("http://127.0.0.1:"+agentHealth+"/readyz") == http.StatusOK })

	backend := httpBackend(t)
	conn, err := net.Dial("unix", uds)
	if err != nil {
		t.Fatal(err)
	}
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /x HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n", backend)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	conn.Close()
	if string(body) != "backend /x" {
		t.Fatalf("body %q", body)
	}

	// Metrics move with the dial, on the health and admin ports alike.
	for _, port := range []string{healthPort, adminPort} {
		text := httpBody(t, "http://127.0.0.1:"+port+"/metrics")
		for _, want := range []string{
			"konnectivity_network_proxy_server_dial_duration_seconds_count 1\n",
			`konnectivity_network_proxy_server_dial_failure_count{reason="no_agent"} 0`,
			"konnectivity_network_proxy_server_ready_backend_connections 1\n",
			`konnectivity_network_proxy_server_certificate_not_after_seconds{listener="agents"}`,
			"# TYPE konnectivity_network_proxy_server_dial_duration_seconds histogram",
		} {
			if !strings.Contains(text, want) {
				t.Errorf("server metrics on port %s lack %q", port, want)
			}
		}
	}
	agentText := httpBody(t, "http://127.0.0.1:"+agentHealth+"/metrics")
	if !strings.Contains(agentText, "konnectivity_network_proxy_agent_open_server_connections 1\n") {
		t.Errorf("agent metrics lack open_server_connections 1:\n%s", agentText)
	}
	// The status table, from the admin ports.
	var table bytes.Buffer
	if code := runStatus([]string{"--admin-address=127.0.0.1:" + adminPort}, &table, io.Discard); code != 0 || !strings.Contains(table.String(), "a1 ") || !strings.Contains(table.String(), "1 agent(s)") {
		t.Errorf("server status (exit %d):\n%s", code, table.String())
	}
	table.Reset()
	if code := runStatus([]string{"--admin-address=127.0.0.1:" + agentAdmin}, &table, io.Discard); code != 0 || !strings.Contains(table.String(), "connected 1/1 servers") {
		t.Errorf("agent status (exit %d):\n%s", code, table.String())
	}

	stopAgent()
	cancel()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("command returned %v", err)
		}
	}
	if _, err := os.Stat(uds); !os.IsNotExist(err) {
		t.Errorf("socket still there after stop: %v", err)
	}
}

// TestServicePortZeroIsOff: port 0 in a flag turns the service off.
func TestServicePortZeroIsOff(t *testing.T) {
	if got := servicePort("127.0.0.1", 0); got != "" {
		t.Errorf("servicePort(_, 0) = %q, want off", got)
	}
	if got := servicePort("", 8092); got != ":8092" {
		t.Errorf("servicePort(\"\", 8092) = %q", got)
	}
}

// The agent's node rule needs its node's name and an apiserver config.
func TestAgentNodeRuleFlags(t *testing.T) {
	t.Setenv("NODE_NAME", "")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--proxy-server-host=127.0.0.1", "--allow-destinations=node"}, "set --node-name or $NODE_NAME"},
		{[]string{"--proxy-server-host=127.0.0.1", "--allow-destinations=10.0.0.0/8,node", "--node-name=n1", "--kubeconfig=/nonexistent/kubeconfig"}, "--allow-destinations=node"},
	} {
		var errb bytes.Buffer
		code := runAgent(c.args, io.Discard, &errb)
		if code != 2 || !strings.Contains(errb.String(), c.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", c.args, code, errb.String(), c.want)
		}
	}
}
