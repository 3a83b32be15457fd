package benchproc

import (
	"bufio"
	"context"
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

// StopTimeout is how long Stop waits after SIGTERM before SIGKILL.
const StopTimeout = 10 * time.Second

// Proc is one started process whose output goes to a log file.
type Proc struct {
	// Immutable after Start.
	Name    string
	Args    []string
	LogPath string
	cmd     *exec.Cmd
	done    chan struct{} // closed once reaped, by Start's goroutine
	waitErr error         // written before done is closed

	// StopAfter is how long Stop waits after SIGTERM before SIGKILL (0:
	// StopTimeout); set before Stop is called.
	StopAfter time.Duration

	stopOnce sync.Once
	// Written by the first Stop before it returns.
	graceful bool          // exited on SIGTERM without SIGKILL
	stopTook time.Duration // SIGTERM → exit
}

// Start starts bin with args, its output to logPath, in its own process
// group (a terminal's ctrl-c reaches only the benchmark, which stops its
// children itself) and killed if the benchmark dies (Pdeathsig).
func Start(name, bin string, args []string, logPath string) (*Proc, error) {
	f, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("create %s log: %w", name, err)
	}
	defer f.Close() // the child holds its own copy
	p := &Proc{Name: name, Args: args, LogPath: logPath, done: make(chan struct{})}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout = f
	p.cmd.Stderr = f
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() { // owned by p: ends when the process is reaped
		p.waitErr = p.cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// PID is the process's ID.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// Done is closed once the process has been reaped.
func (p *Proc) Done() <-chan struct{} { return p.done }

// WaitErr is how the process ended; valid once Done is closed.
func (p *Proc) WaitErr() error { return p.waitErr }

// Exited reports whether the process has been reaped.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Stop sends SIGTERM and, after StopAfter, SIGKILL, and waits until the
// process is reaped. Safe to call repeatedly and concurrently.
func (p *Proc) Stop() {
	p.stopOnce.Do(func() {
		if p.Exited() {
			return
		}
		after := p.StopAfter
		if after == 0 {
			after = StopTimeout
		}
		start := time.Now()
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
			p.graceful = true
		case <-time.After(after):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		p.stopTook = time.Since(start)
	})
	<-p.done
}

// Graceful reports whether Stop ended the process with SIGTERM alone, and
// how long it took; valid once Stop returned.
func (p *Proc) Graceful() (bool, time.Duration) { return p.graceful, p.stopTook }

// LogTail returns the last n lines of the process's log.
func (p *Proc) LogTail(n int) string {
	b, err := os.ReadFile(p.LogPath)
	if err != nil {
		return fmt.Sprintf("(read %s: %v)", p.LogPath, err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// LogIssues counts the log's lines and its WARN/ERROR/panic lines (slog
// text or JSON), and returns the first max of the latter.
func (p *Proc) LogIssues(max int) (lines int, warnErr int, sample []string) {
	f, err := os.Open(p.LogPath)
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

// FreePort asks the kernel for an unused loopback port. Another process may
// take it before the child binds it; that fails the child's start loudly.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// WaitHTTP polls http://127.0.0.1:port/path until it answers 200, p exits,
// or within passes.
func WaitHTTP(ctx context.Context, p *Proc, port int, path string, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	client := &http.Client{Timeout: time.Second}
	url := "http://127.0.0.1:" + strconv.Itoa(port) + path
	last := "no answer"
	for {
		if p.Exited() {
			return fmt.Errorf("%s exited before ready (%v); log tail:\n%s", p.Name, p.waitErr, p.LogTail(20))
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return fmt.Errorf("%s request: %w", path, err)
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
			return fmt.Errorf("%s: %s not 200 within %v (last: %s); log tail:\n%s", p.Name, path, within, last, p.LogTail(20))
		case <-time.After(50 * time.Millisecond):
		}
	}
}
