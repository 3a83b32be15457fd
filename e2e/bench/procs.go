package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

const (
	readyTimeout = 20 * time.Second // process up and /readyz 200
	stopTimeout  = 10 * time.Second // SIGTERM → exit, before SIGKILL
)

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

// proc is one started server or agent process.
type proc = benchproc.Proc
