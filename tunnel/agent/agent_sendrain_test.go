package agent

import (
	"bufio"
	"context"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"
)

// TestAgentRestartOnlyToServersThatSaySo: the server's answer names
// agent-restart, and an answer without it (an older server) gets no
// restart-in line: the agent only drains there.
func TestAgentRestartOnlyToServersThatSaySo(t *testing.T) {
	var b strings.Builder
	if _, err := b.Write(wire.Switching("s1", 2)); err != nil {
		t.Fatal(err)
	}
	r, err := wire.ReadReply(bufio.NewReader(strings.NewReader(b.String())))
	if err != nil || !r.AgentRestart || r.ServerID != "s1" || r.Count != 2 {
		t.Fatalf("our server's answer read as %+v, %v; want agent-restart", r, err)
	}
	old := "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + wire.UpgradeToken + "\r\n" + wire.HdrServerID + ": s1\r\n" + wire.HdrServerCount + ": 1\r\n\r\n"
	r, err = wire.ReadReply(bufio.NewReader(strings.NewReader(old)))
	if err != nil || r.AgentRestart {
		t.Fatalf("an older server's answer read as %+v, %v; want no agent-restart", r, err)
	}
	// The control stream's drain for a restart, to each kind of server.
	for _, tc := range []struct {
		agentRestart bool
		want         string
	}{{true, wire.ControlRestartIn + " "}, {false, wire.ControlDrainIn + " "}} {
		a, err := New(Config{ServerAddrs: []string{"127.0.0.1:1"}, ID: "a1", TLS: neverTLS})
		if err != nil {
			t.Fatal(err)
		}
		a.Restarting()
		a.beginDrain()
		l := &connToServer{drain: make(chan struct{}), agentRestart: tc.agentRestart}
		l.sendDrain()
		ctx, cancel := context.WithCancel(context.Background())
		w := &controlRecorder{h: http.Header{}}
		done := make(chan struct{})
		go func() {
			defer close(done)
			a.serveControl(l, w, (&http.Request{Method: http.MethodGet, URL: &url.URL{Path: wire.ControlPath}}).WithContext(ctx))
		}()
		tunneltest.WaitUntil(t, func() bool { return strings.Contains(w.String(), wire.ControlDrain+"\n") }, "the drain lines")
		cancel()
		<-done
		if got := w.String(); !strings.HasPrefix(got, tc.want) || !strings.HasSuffix(got, wire.ControlDrain+"\n") {
			t.Errorf("agent-restart %v: control stream %q, want it to begin with %q", tc.agentRestart, got, tc.want)
		}
	}
}

// controlRecorder is an http.ResponseWriter whose body a test reads while
// the handler writes.
type controlRecorder struct {
	h  http.Header
	mu sync.Mutex
	b  strings.Builder
}

func (r *controlRecorder) Header() http.Header { return r.h }
func (r *controlRecorder) WriteHeader(int)     {}
func (r *controlRecorder) Flush()              {}
func (r *controlRecorder) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.b.Write(p)
}

func (r *controlRecorder) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.b.String()
}
