package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchpki"
	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

// impl is one implementation under load: a konnectivity binary, or a pair
// of binaries taking upstream's flags.
type impl struct {
	name             string
	bin              string // konnectivity: server and agent are its subcommands
	serverBin, agent string // upstream's pair
}

// otherImpl reads --other: a directory with upstream's binaries, or a file.
func otherImpl(path string) (impl, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return impl{}, fmt.Errorf("--other: %w", err)
	}
	if !fi.IsDir() {
		return impl{name: "other", bin: path}, nil
	}
	s, a := filepath.Join(path, "proxy-server"), filepath.Join(path, "proxy-agent")
	for _, p := range []string{s, a} {
		if _, err := os.Stat(p); err != nil {
			return impl{}, fmt.Errorf("--other %s: %w", path, err)
		}
	}
	return impl{name: "upstream", serverBin: s, agent: a}, nil
}

// streamWindow is the receive window a konnectivity stream starts with
// (h2link's DefaultStreamWindow): the unit of the windows' bound.
const streamWindow = 1 << 20

// readyWithin bounds a process's start.
const readyWithin = 20 * time.Second

// pair is a started server and agent.
type pair struct {
	server, agent *benchproc.Proc
	sock          string
}

func (p *pair) stop() {
	if p.agent != nil {
		p.agent.Stop()
	}
	if p.server != nil {
		p.server.Stop()
	}
}

// start runs im's server and agent in dir, as the benchmarks do: the
// server's HTTP CONNECT front door on a Unix socket, the agent over mTLS
// on loopback, default flags otherwise.
func start(ctx context.Context, im impl, dir string, tunnels int) (*pair, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	pki, err := benchpki.Mint(dir, "stress")
	if err != nil {
		return nil, err
	}
	ports := make([]int, 5)
	for i := range ports {
		if ports[i], err = benchproc.FreePort(); err != nil {
			return nil, err
		}
	}
	// Every port is named: upstream refuses 0 for its admin ports.
	agentPort, serverHealth, agentHealth, serverAdmin, agentAdmin := ports[0], ports[1], ports[2], ports[3], ports[4]
	p := &pair{sock: filepath.Join(dir, "konnectivity.sock")}
	serverArgs := []string{
		"--mode=http-connect",
		"--uds-name=" + p.sock,
		"--server-port=0",
		"--agent-bind-address=127.0.0.1",
		"--agent-port=" + strconv.Itoa(agentPort),
		"--cluster-cert=" + pki.ServerCert,
		"--cluster-key=" + pki.ServerKey,
		"--cluster-ca-cert=" + pki.CACert,
		"--health-bind-address=127.0.0.1",
		"--health-port=" + strconv.Itoa(serverHealth),
		"--admin-bind-address=127.0.0.1",
		"--admin-port=" + strconv.Itoa(serverAdmin),
	}
	agentArgs := []string{
		"--proxy-server-host=127.0.0.1",
		"--proxy-server-port=" + strconv.Itoa(agentPort),
		"--ca-cert=" + pki.CACert,
		"--agent-cert=" + pki.AgentCert,
		"--agent-key=" + pki.AgentKey,
		"--agent-id=stress",
		"--health-server-host=127.0.0.1",
		"--health-server-port=" + strconv.Itoa(agentHealth),
		"--admin-bind-address=127.0.0.1",
		"--admin-server-port=" + strconv.Itoa(agentAdmin),
	}
	serverBin, agentBin := im.bin, im.bin
	if im.bin != "" {
		serverArgs = append([]string{"server"}, serverArgs...)
		agentArgs = append([]string{"agent"}, agentArgs...)
		agentArgs = append(agentArgs, streamCaps(im.bin, tunnels)...)
	} else {
		serverBin, agentBin = im.serverBin, im.agent
	}
	if p.server, err = benchproc.Start("server", serverBin, serverArgs, filepath.Join(dir, "server.log")); err != nil {
		return nil, err
	}
	if err := benchproc.WaitHTTP(ctx, p.server, serverHealth, "/healthz", readyWithin); err != nil {
		p.stop()
		return nil, err
	}
	if p.agent, err = benchproc.Start("agent", agentBin, agentArgs, filepath.Join(dir, "agent.log")); err != nil {
		p.stop()
		return nil, err
	}
	for _, w := range []struct {
		p    *benchproc.Proc
		port int
	}{{p.server, serverHealth}, {p.agent, agentHealth}} {
		if err := benchproc.WaitHTTP(ctx, w.p, w.port, "/readyz", readyWithin); err != nil {
			p.stop()
			return nil, err
		}
	}
	return p, nil
}

// streamCaps lifts our agent's tunnel caps to the run's count with room:
// left at their defaults they derive from RLIMIT_NOFILE.
func streamCaps(bin string, tunnels int) []string {
	help, _ := exec.Command(bin, "agent", "--help").CombinedOutput()
	if !strings.Contains(string(help), "-max-streams-total") {
		return nil
	}
	n := strconv.Itoa(2*tunnels + 100)
	return []string{"--max-streams=" + n, "--max-streams-total=" + n}
}

// hogs runs n CPU-bound processes for d: `sh -c 'while :; do :; done'`,
// killed at d or when ctx ends, whichever comes first. stopped is closed
// once all of them have exited.
func hogs(ctx context.Context, n int, d time.Duration) (stopped <-chan struct{}, err error) {
	done := make(chan struct{})
	if n == 0 {
		close(done)
		return done, nil
	}
	var cmds []*exec.Cmd
	for range n {
		c := exec.Command("sh", "-c", "while :; do :; done")
		c.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		if err := c.Start(); err != nil {
			for _, c := range cmds {
				c.Process.Kill()
				c.Wait()
			}
			return nil, fmt.Errorf("start a CPU hog: %w", err)
		}
		cmds = append(cmds, c)
	}
	go func() { // owned by the run: ends at d or with ctx, having reaped every hog
		defer close(done)
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		for _, c := range cmds {
			c.Process.Kill()
			c.Wait()
		}
	}()
	return done, nil
}
