//lint:file-ignore SA1019 the caller uses x/net/http2's Transport for HTTP/2 with prior knowledge, as kube-apiserver's gRPC client does.

package server

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"

	"golang.org/x/net/http2"

	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
)

// grpcCallerEnv makes the test binary the other side of
// BenchmarkIdleGRPCCalls: agents, their echo destination and the gRPC
// client, in a process of their own, so the benchmark's process holds
// only the server.
const grpcCallerEnv = "KONNECTIVITY_TEST_GRPC_CALLER"

// callsPerGRPCConn is how many calls the caller multiplexes on one gRPC
// connection, as the scale benchmark's fleet does.
const callsPerGRPCConn = 800

// runGRPCCaller connects CALLER_AGENTS agents to CALLER_ADDR; once a line
// comes on stdin it opens CALLER_CALLS calls on the gRPC socket
// CALLER_SOCK, each echoing a byte through an agent, prints "open N", and
// holds them until stdin closes.
func runGRPCCaller() int {
	dir := os.Getenv(grpcCallerEnv)
	agents, _ := strconv.Atoi(os.Getenv("CALLER_AGENTS"))
	calls, _ := strconv.Atoi(os.Getenv("CALLER_CALLS"))
	addr, sock := os.Getenv("CALLER_ADDR"), os.Getenv("CALLER_SOCK")
	fail := func(what string, err error) int {
		fmt.Fprintf(os.Stderr, "grpc caller: %s: %v\n", what, err)
		return 1
	}

	echoLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail("echo listener", err)
	}
	go func() {
		for {
			c, err := echoLn.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(c, c); c.Close() }()
		}
	}()
	echo := echoLn.Addr().String()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := runChildAgents(ctx, dir, addr, "caller", agents); err != nil {
		return fail("agents", err)
	}

	stdin := bufio.NewReader(os.Stdin)
	if _, err := stdin.ReadString('\n'); err != nil {
		return fail("wait for the go-ahead", err)
	}
	var tr *http2.Transport
	for i := range calls {
		if i%callsPerGRPCConn == 0 {
			tr = &http2.Transport{
				AllowHTTP: true,
				DialTLSContext: func(ctx context.Context, _, _ string, _ *tls.Config) (net.Conn, error) {
					return (&net.Dialer{}).DialContext(ctx, "unix", sock)
				},
			}
		}
		if err := openEchoedCall(ctx, tr, echo, i); err != nil {
			return fail(fmt.Sprintf("call %d", i), err)
		}
	}
	fmt.Printf("open %d\n", calls)
	io.Copy(io.Discard, stdin)
	return 0
}

// openEchoedCall opens one call on tr to echo and echoes a byte through it;
// the call stays open until the process exits.
func openEchoedCall(ctx context.Context, tr *http2.Transport, echo string, i int) error {
	pr, pw := io.Pipe()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://konnectivity"+grpcwire.ProxyMethod, pr)
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("Te", "trailers")
	respc := make(chan *http.Response, 1)
	errc := make(chan error, 1)
	go func() {
		resp, err := tr.RoundTrip(req)
		if err != nil {
			errc <- err
			return
		}
		respc <- resp
	}()
	if _, err := pw.Write(grpcwire.AppendMessage(nil, grpcwire.Packet{Type: grpcwire.DialReq, Protocol: "tcp", Address: echo, Random: int64(i)})); err != nil {
		return fmt.Errorf("write DIAL_REQ: %w", err)
	}
	var resp *http.Response
	select {
	case resp = <-respc:
	case err := <-errc:
		return err
	}
	read := func() (grpcwire.Packet, error) {
		msg, _, err := grpcwire.ReadMessage(resp.Body, nil, grpcwire.MaxMessageLen)
		if err != nil {
			return grpcwire.Packet{}, err
		}
		return grpcwire.Decode(msg)
	}
	rsp, err := read()
	if err != nil || rsp.Type != grpcwire.DialRsp || rsp.Error != "" {
		return fmt.Errorf("DIAL_RSP: %+v, %v", rsp, err)
	}
	if _, err := pw.Write(grpcwire.AppendMessage(nil, grpcwire.Packet{Type: grpcwire.Data, ConnectID: rsp.ConnectID, Data: []byte("x")})); err != nil {
		return fmt.Errorf("write DATA: %w", err)
	}
	if p, err := read(); err != nil || p.Type != grpcwire.Data || string(p.Data) != "x" {
		return fmt.Errorf("echo: %+v, %v", p, err)
	}
	return nil
}

// BenchmarkIdleGRPCCalls opens idle calls through the gRPC front door, on
// connections of 800 calls each, through agents in another process, and
// prints what each idle call costs the server: heap, stacks, goroutines
// and resident memory, after two collections and a return of free memory
// (as the daemon's trim leaves it). KONNECTIVITY_BENCH_HEAP=file writes a
// heap profile of the held calls, every allocation sampled.
// Run: go test -run '^$' -bench IdleGRPCCalls -benchtime 1x ./tunnel/
func BenchmarkIdleGRPCCalls(b *testing.B) {
	const (
		agents = 100
		calls  = 2000
	)
	profile := os.Getenv("KONNECTIVITY_BENCH_HEAP")
	if profile != "" {
		defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
		runtime.MemProfileRate = 1
	}
	for range b.N {
		p := tunneltest.NewPKI(b)
		dir := writeAgentFiles(b, p)

		e := newEnvOn(b, p, "127.0.0.1:0", nil)
		sock := e.grpcSocket(b)
		cmd := exec.Command(os.Args[0])
		cmd.Env = append(os.Environ(), grpcCallerEnv+"="+dir, "CALLER_AGENTS="+strconv.Itoa(agents),
			"CALLER_CALLS="+strconv.Itoa(calls), "CALLER_ADDR="+e.AgentAddr, "CALLER_SOCK="+sock)
		cmd.Stderr = os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		stdin, _ := cmd.StdinPipe()
		stdout, _ := cmd.StdoutPipe()
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		stopCaller := func() { stdin.Close(); cmd.Wait() }
		deadline := time.Now().Add(60 * time.Second)
		for e.srv.AgentCount() < agents {
			if time.Now().After(deadline) {
				stopCaller()
				b.Fatalf("only %d of %d agents connected in 60s", e.srv.AgentCount(), agents)
			}
			time.Sleep(10 * time.Millisecond)
		}
		m0 := serverMem()
		io.WriteString(stdin, "go\n")
		opened := make(chan string, 1)
		go func() {
			line, _ := bufio.NewReader(stdout).ReadString('\n')
			opened <- strings.TrimSpace(line)
		}()
		select {
		case line := <-opened:
			if line != fmt.Sprintf("open %d", calls) {
				stopCaller()
				b.Fatalf("caller: %q", line)
			}
		case <-time.After(2 * time.Minute):
			cmd.Process.Kill()
			stopCaller()
			b.Fatalf("the caller did not open %d calls in 2 minutes", calls)
		}
		// The calls are idle once only their waiters are left, and each
		// connection's read loop.
		idle := m0.goroutines + calls + (calls+callsPerGRPCConn-1)/callsPerGRPCConn
		deadline = time.Now().Add(30 * time.Second)
		for runtime.NumGoroutine() > idle {
			if n := runtime.NumGoroutine(); time.Now().After(deadline) {
				stopCaller()
				b.Fatalf("%d goroutines with %d calls idle, want %d", n, calls, idle)
			}
			time.Sleep(10 * time.Millisecond)
		}
		m1 := serverMem()
		if profile != "" {
			if f, err := os.Create(profile); err == nil {
				pprof.WriteHeapProfile(f)
				f.Close()
			}
		}
		stopCaller()

		per := func(a, b uint64) float64 { return (float64(b) - float64(a)) / calls / 1024 }
		heap, stack, rss := per(m0.heap, m1.heap), per(m0.stack, m1.stack), per(m0.rss, m1.rss)
		b.ReportMetric(heap, "KiB-heap/call")
		b.ReportMetric(stack, "KiB-stack/call")
		b.ReportMetric(rss, "KiB-RSS/call")
		b.Logf("server per idle gRPC call (%d calls, %d agents, %d calls a connection): heap %.2f KiB, stacks %.2f KiB, %.2f goroutines; RSS %.2f KiB",
			calls, agents, callsPerGRPCConn, heap, stack, float64(m1.goroutines-m0.goroutines)/calls, rss)
	}
}

// memFigures is what a process holds, after two collections and a return
// of free memory to the OS.
type memFigures struct {
	heap, stack, rss uint64
	goroutines       int
}

func serverMem() memFigures {
	runtime.GC()
	debug.FreeOSMemory()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return memFigures{heap: ms.HeapInuse, stack: ms.StackInuse, rss: uint64(selfRSS()), goroutines: runtime.NumGoroutine()}
}
