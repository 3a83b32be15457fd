package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

const (
	readyTimeout = 30 * time.Second // a process up and answering
	stopTimeout  = 20 * time.Second // asked to stop → exited, before SIGKILL
	callTimeout  = 60 * time.Second // one request to a helper answered
)

// helperEnv makes this binary a helper process instead of the benchmark:
// "agents" (the product's agents, in-process), "upstream-agents" (agents
// speaking upstream's agent protocol, in-process) or "echo" (a
// destination). Its settings are JSON in helperArgsEnv.
const (
	helperEnv     = "KONNECTIVITY_SCALE_HELPER"
	helperArgsEnv = "KONNECTIVITY_SCALE_HELPER_ARGS"
)

// runHelper runs this process as the helper named by role until its stdin
// closes, and returns the exit status.
func runHelper(role string) int {
	raiseNofile()
	var err error
	switch role {
	case "agents":
		err = runFleet(os.Stdin, os.Stdout, newProductAgent)
	case "upstream-agents":
		err = runFleet(os.Stdin, os.Stdout, newUpstreamAgent)
	case "echo":
		err = runEcho(os.Stdin, os.Stdout)
	default:
		err = fmt.Errorf("unknown helper role %q", role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "scale %s helper: %v\n", role, err)
		return 1
	}
	return 0
}

// raiseNofile lifts this process's descriptor limit to its hard limit;
// children inherit it.
func raiseNofile() uint64 {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 1024
	}
	if lim.Cur < lim.Max {
		lim.Cur = lim.Max
		_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
		_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	return lim.Cur
}

// helper is a started helper process, spoken to one line at a time: a
// request on its stdin, one answer line on its stdout. Closing its stdin
// tells it to stop.
type helper struct {
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed once reaped

	mu    sync.Mutex // serializes requests; guards stdin and out
	stdin io.WriteCloser
	out   *bufio.Reader
	outF  *os.File // for read deadlines

	stopOnce sync.Once
}

// startHelper re-executes this binary as a helper of the given role, with
// args as its JSON settings and its stderr in logPath, and waits for its
// first line ("ready ..."), whose rest it returns.
func startHelper(ctx context.Context, name, role string, args any, logPath string) (*helper, string, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", name, err)
	}
	js, err := json.Marshal(args)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", name, err)
	}
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, "", fmt.Errorf("%s log: %w", name, err)
	}
	defer logf.Close() // the child holds its own copy
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), helperEnv+"="+role, helperArgsEnv+"="+string(js))
	cmd.Stderr = logf
	// Own process group: a terminal's ctrl-c reaches only the benchmark,
	// which stops its children itself; Pdeathsig covers it being killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, "", err
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, "", err
	}
	cmd.Stdout = pw
	if err := cmd.Start(); err != nil {
		pr.Close()
		pw.Close()
		return nil, "", fmt.Errorf("start %s: %w", name, err)
	}
	pw.Close()
	h := &helper{name: name, cmd: cmd, done: make(chan struct{}), stdin: stdin, out: bufio.NewReader(pr), outF: pr}
	go func() { // owned by h: ends when the process is reaped
		_ = cmd.Wait()
		pr.Close()
		close(h.done)
	}()
	line, err := h.readLine(ctx, readyTimeout)
	if err != nil {
		h.stop()
		return nil, "", fmt.Errorf("%s: no ready line (%w); see %s", name, err, logPath)
	}
	rest, ok := strings.CutPrefix(line, "ready")
	if !ok {
		h.stop()
		return nil, "", fmt.Errorf("%s: first line %q, want ready; see %s", name, line, logPath)
	}
	return h, strings.TrimSpace(rest), nil
}

func (h *helper) pid() int { return h.cmd.Process.Pid }

// readLine reads one line within d (or until ctx ends).
func (h *helper) readLine(ctx context.Context, d time.Duration) (string, error) {
	dl := time.Now().Add(d)
	if cdl, ok := ctx.Deadline(); ok && cdl.Before(dl) {
		dl = cdl
	}
	_ = h.outF.SetReadDeadline(dl)
	stop := context.AfterFunc(ctx, func() { _ = h.outF.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	s, err := h.out.ReadString('\n')
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(s), nil
}

// call sends one request line and returns the answer line; an answer
// starting "error" is returned as an error.
func (h *helper) call(ctx context.Context, req string) (string, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, err := io.WriteString(h.stdin, req+"\n"); err != nil {
		return "", fmt.Errorf("%s: send %q: %w", h.name, req, err)
	}
	ans, err := h.readLine(ctx, callTimeout)
	if err != nil {
		return "", fmt.Errorf("%s: answer to %q: %w", h.name, req, err)
	}
	if msg, ok := strings.CutPrefix(ans, "error"); ok {
		return "", fmt.Errorf("%s: %q: %s", h.name, req, strings.TrimSpace(msg))
	}
	return ans, nil
}

// stop closes the helper's stdin and waits for it to exit, killing it
// after stopTimeout. Safe to call more than once and concurrently.
func (h *helper) stop() {
	h.stopOnce.Do(func() {
		h.mu.Lock()
		h.stdin.Close()
		h.mu.Unlock()
		select {
		case <-h.done:
		case <-time.After(stopTimeout):
			_ = h.cmd.Process.Kill()
		}
	})
	<-h.done
}

// kv parses "word k=v k=v ..." answers.
func kv(line string) map[string]string {
	m := map[string]string{}
	for _, f := range strings.Fields(line) {
		if k, v, ok := strings.Cut(f, "="); ok {
			m[k] = v
		}
	}
	return m
}

func kvInt(m map[string]string, k string) int64 {
	n, _ := strconv.ParseInt(m[k], 10, 64)
	return n
}

// scrape reads the named samples (exact series text, e.g.
// `go_goroutines`) from a Prometheus text endpoint; missing ones are absent
// from the map.
func scrape(ctx context.Context, port int, names ...string) (map[string]float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	url := "http://127.0.0.1:" + strconv.Itoa(port) + "/metrics"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("get %s: %w", url, err)
	}
	defer resp.Body.Close()
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	got := map[string]float64{}
	sc := bufio.NewScanner(io.LimitReader(resp.Body, 16<<20))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		i := strings.LastIndexByte(l, ' ')
		if i < 0 || strings.HasPrefix(l, "#") || !want[l[:i]] {
			continue
		}
		if v, err := strconv.ParseFloat(l[i+1:], 64); err == nil {
			got[l[:i]] = v
		}
	}
	return got, sc.Err()
}

const clockTicks = 100

// nofileOf reads the soft descriptor limit of pid from /proc/PID/limits.
func nofileOf(pid int) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/limits")
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Max open files"); ok {
			if f := strings.Fields(v); len(f) > 0 {
				return strconv.ParseInt(f[0], 10, 64)
			}
		}
	}
	return 0, fmt.Errorf("no open-files limit for %d", pid)
}

// proc is one started server or agent process.
type proc = benchproc.Proc
