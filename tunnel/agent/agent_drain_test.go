package agent

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/server"
)

// TestAgentDrainTakesNoStreamOnceIdle: once an agent's drain found no
// tunnel open, a CONNECT stream that reaches its link before its GOAWAY is
// refused unprocessed (REFUSED_STREAM), and the server dials it through
// another agent: the draining agent answers no tunnel that its close would
// cut. The window is held open without timing: the agent's seeker is in a
// server dial (the server announces two servers) that returns only once
// the test lets it, and Run sends GOAWAY only after its seekers returned,
// which they do once the drain ended (the dial's context ends then).
func TestAgentDrainTakesNoStreamOnceIdle(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, func(c *server.Config) {
		c.Count = 2                    // the seeker looks for a second server
		c.AgentWait = 10 * time.Second // a refused dial waits for the next agent
	})
	dest := tunneltest.EchoServer(t)

	var dials atomic.Int32
	stopped, release := make(chan struct{}), make(chan struct{})
	stop, let := sync.OnceFunc(func() { close(stopped) }), sync.OnceFunc(func() { close(release) })
	defer let() // before the agent's cleanup waits for its seeker
	var d net.Dialer
	a1 := e.startAgent("a1", "", func(c *Config) {
		c.ServerDialer = func(ctx context.Context, addr string) (net.Conn, error) {
			if dials.Add(1) == 1 {
				return d.DialContext(ctx, "tcp", addr)
			}
			<-ctx.Done() // the agent stopped connecting: its drain ended
			stop()
			<-release
			return nil, ctx.Err()
		}
	})
	e.WaitAgents(1)
	tunneltest.WaitUntil(t, func() bool { return dials.Load() == 2 }, "the seeker dialling for a second server")
	a1.Cancel() // SIGTERM: nothing is open, so the drain ends at once
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("the draining agent did not stop connecting")
	}

	// a1 is past its drain and has not sent GOAWAY: a dial comes, and a1
	// is the server's only agent.
	type answer struct {
		c    net.Conn
		br   *bufio.Reader
		resp *http.Response
		err  error
	}
	got := make(chan answer, 1)
	go func() {
		c, err := net.DialTimeout("unix", e.UDS, 5*time.Second)
		if err != nil {
			got <- answer{err: err}
			return
		}
		c.SetDeadline(time.Now().Add(20 * time.Second))
		fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", dest)
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		got <- answer{c, br, resp, err}
	}()
	const refusedSeries = `konnectivity_network_proxy_server_stream_errors_total{segment="to_agent",code="%s",packet_type="DIAL_REQ"}`
	var ans answer
	answered := false
	tunneltest.WaitUntil(t, func() bool {
		select {
		case ans = <-got:
			answered = true
			return true
		default:
		}
		refused := 0.0
		for _, code := range []string{"Canceled", "Unavailable"} {
			refused += max(tunneltest.Metric(t, e.metrics, fmt.Sprintf(refusedSeries, code)), 0)
		}
		return refused >= 1
	}, "the dial answered by the draining agent, or refused by it")
	let()
	select {
	case <-a1.Done:
	case <-time.After(10 * time.Second):
		t.Fatal("the draining agent did not stop")
	}
	a2 := e.startAgent("a2", "", nil)
	if !answered {
		select {
		case ans = <-got:
		case <-time.After(20 * time.Second):
			t.Fatal("no answer to the dial")
		}
	}
	if ans.err != nil {
		t.Fatalf("the dial: %v", ans.err)
	}
	defer ans.c.Close()
	if ans.resp.StatusCode != http.StatusOK {
		t.Fatalf("the dial: %s", ans.resp.Status)
	}
	if n := dialsOK(t, a1.Agent); n != 0 {
		t.Errorf("the draining agent dialled %d destinations after its drain had ended, want 0", n)
	}
	if n := dialsOK(t, a2.Agent); n != 1 {
		t.Errorf("the next agent dialled %d destinations, want 1 (the dial the draining agent refused)", n)
	}
	b := make([]byte, 1)
	if _, err := ans.c.Write([]byte("x")); err != nil {
		t.Fatalf("the tunnel, once the draining agent had gone: %v", err)
	}
	if _, err := io.ReadFull(ans.br, b); err != nil || b[0] != 'x' {
		t.Fatalf("the tunnel, once the draining agent had gone: read %q, %v", b, err)
	}
}
