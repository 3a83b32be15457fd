package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	readyTimeout = 20 * time.Second // process up and /readyz 200
	stopTimeout  = 10 * time.Second // SIGTERM → exit, before SIGKILL
)

// proc is one started server or agent process.
type proc struct {
	name    string
	args    []string
	logPath string
	cmd     *exec.Cmd
	logFile *os.File
	done    chan struct{} // closed once reaped
	waitErr error         // valid after done

	stopOnce sync.Once
	graceful bool          // exited on SIGTERM without SIGKILL
	stopTook time.Duration // SIGTERM → exit
}

func startProc(name, bin string, args []string, logPath string) (*proc, error) {
	f, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("create %s log: %w", name, err)
	}
	p := &proc{name: name, args: args, logPath: logPath, logFile: f, done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout = f
	p.cmd.Stderr = f
	// Own process group: a terminal ctrl-c reaches only the bench, which then
	// stops the children itself. Pdeathsig covers the bench being killed hard.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() {
		p.waitErr = p.cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM and, after stopTimeout, SIGKILL. Safe to call repeatedly
// and concurrently; later calls wait for the first to finish.
func (p *proc) stop() {
	p.stopOnce.Do(func() {
		if p.exited() {
			return
		}
		start := time.Now()
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
			p.graceful = true
		case <-time.After(stopTimeout):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		p.stopTook = time.Since(start)
	})
	<-p.done
}

// logTail returns the last n lines of the process's log.
func (p *proc) logTail(n int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return fmt.Sprintf("(read %s: %v)", p.logPath, err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// logIssues counts WARN/ERROR lines (slog text or JSON) and returns the
// first few of them.
func (p *proc) logIssues(max int) (lines int, warnErr int, sample []string) {
	f, err := os.Open(p.logPath)
	if err != nil {
		return 0, 0, nil
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		lines++
		l := sc.Text()
		if strings.Contains(l, "level=ERROR") || strings.Contains(l, "level=WARN") ||
			strings.Contains(l, `"level":"ERROR"`) || strings.Contains(l, `"level":"WARN"`) ||
			strings.Contains(l, "panic") {
			warnErr++
			if len(sample) < max {
				sample = append(sample, l)
			}
		}
	}
	return lines, warnErr, sample
}

// freePort asks the kernel for an unused loopback port. Another process may
// take it before the child binds it; that would fail startup loudly.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// waitHTTP polls http://127.0.0.1:port/path until 200.
func waitHTTP(ctx context.Context, p *proc, port int, path string) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	client := &http.Client{Timeout: time.Second}
	url := "http://127.0.0.1:" + strconv.Itoa(port) + path
	last := "no answer"
	for {
		if p.exited() {
			return fmt.Errorf("%s exited before ready (%v); log tail:\n%s", p.name, p.waitErr, p.logTail(20))
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return fmt.Errorf("readyz request: %w", err)
		}
		resp, err := client.Do(req)
		if err == nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = resp.Status
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %s not 200 within %v (last: %s); log tail:\n%s", p.name, path, readyTimeout, last, p.logTail(20))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// goroutineCount reads a process's goroutine count from its admin port:
// go_goroutines from /metrics, else the total of a pprof goroutine profile
// (for binaries without the gauge). The gauge comes first because a
// goroutine profile symbolizes every stack, which pages in much of the
// binary and would show up in the idle memory the bench measures.
func goroutineCount(ctx context.Context, port int) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if v, err := adminLine(ctx, port, "/metrics", "go_goroutines "); err == nil {
		f, err := strconv.ParseFloat(v, 64)
		return int(f), err
	}
	v, err := adminLine(ctx, port, "/debug/pprof/goroutine?debug=1", "goroutine profile: total ")
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(v)
}

// adminLine fetches path from 127.0.0.1:port and returns what follows
// prefix on the first line that starts with it.
func adminLine(ctx context.Context, port int, path, prefix string) (string, error) {
	url := "http://127.0.0.1:" + strconv.Itoa(port) + path
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("get %s: %w", url, err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(io.LimitReader(resp.Body, 4<<20))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), prefix); ok {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("%s: no line starting %q", url, prefix)
}

// cpuTicks returns utime+stime of pid in clock ticks, from /proc/PID/stat.
func cpuTicks(pid int) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, fmt.Errorf("read stat of %d: %w", pid, err)
	}
	// The command name (field 2) may hold spaces; fields after the last ')'
	// start at field 3 (state). utime and stime are fields 14 and 15.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("parse stat of %d: no ')'", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("parse stat of %d: %d fields", pid, len(f))
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, fmt.Errorf("parse stat of %d: %w", pid, err)
	}
	return ut + st, nil
}

// clockTicks is USER_HZ from `getconf CLK_TCK`; it is 100 on every Linux
// architecture Go supports, which is the fallback.
func clockTicks() int64 {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "getconf", "CLK_TCK").Output()
	if err == nil {
		if n, err := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64); err == nil && n > 0 {
			return n
		}
	}
	return 100
}

// ioCounts are the read and write syscall counts of a process.
type ioCounts struct{ syscr, syscw int64 }

// procIO reads syscr and syscw from /proc/PID/io.
func procIO(pid int) (ioCounts, error) {
	var c ioCounts
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/io")
	if err != nil {
		return c, fmt.Errorf("read io of %d: %w", pid, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "syscr":
			c.syscr = n
		case "syscw":
			c.syscw = n
		}
	}
	return c, nil
}

// rssKiB returns VmRSS of pid in KiB.
func rssKiB(pid int) (int64, error) {
	return procStatusKiB(pid, "VmRSS:")
}

func procStatusKiB(pid int, key string) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, fmt.Errorf("read status of %d: %w", pid, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, key) {
			f := strings.Fields(l[len(key):])
			if len(f) == 0 {
				break
			}
			return strconv.ParseInt(f[0], 10, 64)
		}
	}
	return 0, fmt.Errorf("no %s in status of %d", key, pid)
}

// machineInfo describes where the numbers come from.
func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "model name") {
			if i := strings.IndexByte(l, ':'); i >= 0 {
				return strings.TrimSpace(l[i+1:])
			}
		}
	}
	return "unknown"
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return strings.TrimSpace(string(b))
	}
	return strings.Join(f[:3], " ")
}
