package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	apiserverapi "k8s.io/apiserver/pkg/apis/apiserver"
)

// TestAgentRestartKeepsTunnels: an agent's SIGHUP (rc-service
// konnectivity-agent reload) hands its tunnels to its next image
// (docs/restart.md, "An agent's restart"): across three SIGHUPs in a row,
// a long download (what kubectl logs -f is: a destination that writes a
// numbered line every 2 ms) arrives with no line lost or repeated, and
// keep-alive clients sending POSTs back to back lose none and keep their
// connection. Both front doors, through kube-apiserver's own dialer, with
// the only agent restarting.
func TestAgentRestartKeepsTunnels(t *testing.T) {
	t.Run("http-connect", func(t *testing.T) { agentRestartKeepsTunnels(t, apiserverapi.ProtocolHTTPConnect, 0) })
	t.Run("grpc", func(t *testing.T) { agentRestartKeepsTunnels(t, apiserverapi.ProtocolGRPC, 0) })
	// SIGHUPs faster than a restart completes: each lands in a drain, an
	// exec, or a new image before or after it logged in and resumed.
	t.Run("http-connect-10-sighups-50ms-apart", func(t *testing.T) {
		agentRestartKeepsTunnels(t, apiserverapi.ProtocolHTTPConnect, 50*time.Millisecond)
	})
	t.Run("grpc-10-sighups-50ms-apart", func(t *testing.T) {
		agentRestartKeepsTunnels(t, apiserverapi.ProtocolGRPC, 50*time.Millisecond)
	})
}

// lineSource is a destination that, once its client sent a byte (its
// request: a destination that spoke first would answer before the
// CONNECT's 200 is read), writes "%08d\n" lines, numbered from 0, every
// 2 ms until its client goes; it counts its connections.
func lineSource(t *testing.T) (*tcpBackend, *atomic.Int64) {
	accepted := new(atomic.Int64)
	b := startTCPBackend(t, "127.0.0.1", func(c net.Conn) {
		accepted.Add(1)
		if _, err := c.Read(make([]byte, 1)); err != nil {
			return
		}
		go io.Copy(io.Discard, c) // ends with the connection
		for i := 0; ; i++ {
			if _, err := fmt.Fprintf(c, "%08d\n", i); err != nil {
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	})
	return b, accepted
}

// lineReader reads a lineSource's stream and checks every line's number.
type lineReader struct {
	lines atomic.Int64
	err   chan error // the first wrong line or read error
}

func readLines(c net.Conn) *lineReader {
	r := &lineReader{err: make(chan error, 1)}
	go func() {
		sc := bufio.NewScanner(c)
		for sc.Scan() {
			want := fmt.Sprintf("%08d", r.lines.Load())
			if sc.Text() != want {
				r.err <- fmt.Errorf("line %q where %q was due", sc.Text(), want)
				return
			}
			r.lines.Add(1)
		}
		r.err <- fmt.Errorf("stream ended after %d lines: %v", r.lines.Load(), sc.Err())
	}()
	return r
}

// agentRestartKeepsTunnels sends the agent hups SIGHUPs, each once the
// last one's new image serves, or, with apart set, ten that far apart.
func agentRestartKeepsTunnels(t *testing.T, proto apiserverapi.ProtocolType, apart time.Duration) {
	mode := "--mode=http-connect"
	if proto == apiserverapi.ProtocolGRPC {
		mode = "--mode=grpc"
	}
	s := startServer(t, mode, "--agent-wait=10s")
	// a1 runs from a private copy: the shared binary may be rebuilt meanwhile.
	bin := copyExecutable(t, t.TempDir())
	a1 := s.launchAgentFrom(t, bin, nil, s.pki, "a1", "", "--drain-timeout=5s", "--sync-interval=100ms", "--sync-interval-cap=500ms")
	waitHTTP(t, a1.proc, a1.healthURL("/readyz"), 200)
	s.waitAgents(t, 1, startTimeout)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	source, accepted := lineSource(t)
	d := s.egressDialerProto(t, proto)
	checkReachable(t, d, backend, "b1", 3)
	pid := a1.proc.cmd.Process.Pid
	metricsURL := a1.healthURL("/metrics")

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	stream, err := d.bounded()(ctx, "tcp", source.addr())
	cancel()
	if err != nil {
		t.Fatalf("dial the line source through the tunnel: %v", err)
	}
	defer stream.Close()
	if _, err := stream.Write([]byte("g")); err != nil {
		t.Fatal(err)
	}
	lines := readLines(stream)

	const workers, hups = 3, 3
	p := startPostWorkers(t, d, backend, workers)
	waitFor(t, 10*time.Second, "lines and POSTs flowing", func() bool {
		select {
		case err := <-lines.err:
			t.Fatalf("download before any SIGHUP: %v", err)
		default:
		}
		if p.failed.Load() > 0 {
			t.Fatalf("POSTs failed before any SIGHUP: %s", p.errors())
		}
		return lines.lines.Load() > 100 && p.ok.Load() > 20
	})
	for i := range hups {
		if apart > 0 {
			break
		}
		before := startTime(metricsURL)
		linesBefore := lines.lines.Load()
		at := time.Now()
		a1.proc.signal(t, syscall.SIGHUP)
		el := waitNewImage(t, a1.proc, metricsURL, before, 20*time.Second)
		waitHTTP(t, a1.proc, a1.healthURL("/readyz"), 200)
		s.waitAgents(t, 1, 10*time.Second)
		checkSameProcess(t, a1.proc, pid, bin)
		waitFor(t, 10*time.Second, "lines flowing after the agent's restart", func() bool { return lines.lines.Load() > linesBefore+100 })
		t.Logf("agent SIGHUP #%d: new image after %v, lines flowing again after %v", i+1, el.Round(time.Millisecond), time.Since(at).Round(time.Millisecond))
	}
	if apart > 0 {
		before := lines.lines.Load()
		for range 10 {
			a1.proc.signal(t, syscall.SIGHUP)
			time.Sleep(apart)
		}
		waitFor(t, 30*time.Second, "the agent's last image serving after the SIGHUPs", func() bool {
			out := a1.proc.out.String()
			return strings.Count(out, "agent starting") == strings.Count(out, "re-executing in place")+1 && lines.lines.Load() > before+100
		})
		waitHTTP(t, a1.proc, a1.healthURL("/readyz"), 200)
		checkSameProcess(t, a1.proc, pid, bin)
		time.Sleep(time.Second)
	}
	p.halt()
	select {
	case err := <-lines.err:
		t.Errorf("download: %v", err)
	default:
	}
	sent := hups
	if apart > 0 {
		sent = 10
	}
	t.Logf("%d lines downloaded and %d keep-alive POSTs across %d agent SIGHUPs (%d re-executions), %d failed",
		lines.lines.Load(), p.ok.Load(), sent, strings.Count(a1.proc.out.String(), "re-executing in place"), p.failed.Load())
	if p.failed.Load() > 0 {
		t.Errorf("%d ok, %d failed:\n%s", p.ok.Load(), p.failed.Load(), p.errors())
	}
	p.checkConns(t, "the agent's restarts")
	if n := accepted.Load(); n != 1 {
		t.Errorf("the line source accepted %d connections, want 1", n)
	}
	out := a1.proc.out.String()
	if n := strings.Count(out, "destinations of paused tunnels handed to the next image"); n != hups && apart == 0 || n == 0 {
		t.Errorf("agent log has %d handovers, want %d:\n%s", n, hups, out)
	}
	if srv := s.proc.out.String(); strings.Contains(srv, "could not be resumed") || strings.Contains(srv, "could not be paused") {
		t.Errorf("a tunnel was lost in an agent's restart:\n%s", srv)
	}
}
