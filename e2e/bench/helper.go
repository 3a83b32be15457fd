package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// helperEnv makes the bench binary act as an echo destination in its own
// process. The 10,000-tunnel figure needs two descriptors per tunnel in one
// process (client and destination end); when RLIMIT_NOFILE cannot be raised
// that far, the destination ends move to this helper.
const helperEnv = "KONNECTIVITY_BENCH_ECHO_HELPER"

// runEchoHelper serves echo on a loopback port, prints the address and
// exits when its stdin closes (the bench ended, however it ended).
func runEchoHelper() int {
	pat := newPattern()
	d, err := startDestination(pat)
	if err != nil {
		fmt.Fprintf(os.Stderr, "echo helper: %v\n", err)
		return 1
	}
	fmt.Println(d.echo.Addr().String())
	_, _ = io.Copy(io.Discard, os.Stdin)
	d.close()
	return 0
}

// helperProc is a started helper process: the bench binary re-executed
// with a helper environment variable. It serves until its stdin closes.
type helperProc struct {
	addr  string // the first line it printed
	cmd   *exec.Cmd
	stdin io.WriteCloser
	done  chan struct{}
}

func startEchoHelper(ctx context.Context) (*helperProc, error) {
	h, err := startHelper(ctx, "echo helper", helperEnv+"=1")
	if err != nil {
		return nil, err
	}
	if _, err := net.ResolveTCPAddr("tcp", h.addr); err != nil || h.addr == "" {
		h.stop()
		return nil, fmt.Errorf("echo helper gave no address (%q)", h.addr)
	}
	return h, nil
}

// startHelper re-executes the bench binary with env (KEY=value) set and
// waits for the first line it prints, its address. The caller checks the
// address and must call stop.
func startHelper(ctx context.Context, name, env string) (*helperProc, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), env)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s %s: %w", name, exe, err)
	}
	h := &helperProc{cmd: cmd, stdin: stdin, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(h.done)
	}()
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(stdout).ReadString('\n')
		line <- strings.TrimSpace(s)
	}()
	select {
	case h.addr = <-line:
	case <-time.After(readyTimeout):
	case <-ctx.Done():
	}
	return h, nil
}

// stop closes the helper's stdin and kills it if it has not exited after
// stopTimeout. Safe to call more than once.
func (h *helperProc) stop() {
	h.stdin.Close()
	select {
	case <-h.done:
	case <-time.After(stopTimeout):
		_ = h.cmd.Process.Kill()
		<-h.done
	}
}
