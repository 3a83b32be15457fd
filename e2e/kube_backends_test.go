package e2e

// The in-cluster peers kube-apiserver reaches through the tunnel in
// TestKubeAPIServer: a validating admission webhook, a kubelet stand-in
// and an aggregated API server. Each listens with TLS on the namespace's
// documentation-range address and records what it was asked.

import (
	"bufio"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/streaming/pkg/httpstream"
	"k8s.io/streaming/pkg/httpstream/spdy"
)

// kubeBackend is one TLS HTTP server on addr.
type kubeBackend struct {
	srv  *http.Server
	l    net.Listener
	port int
	hits atomic.Int64
}

func startKubeBackend(t *testing.T, ip string, cfg *tls.Config, h http.Handler) *kubeBackend {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatalf("listen on %s: %v", ip, err)
	}
	b := &kubeBackend{l: l, port: l.Addr().(*net.TCPAddr).Port}
	cfg.NextProtos = []string{"http/1.1"}
	b.srv = &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b.hits.Add(1)
			h.ServeHTTP(w, r)
		}),
		TLSConfig:         cfg,
		ReadHeaderTimeout: 10 * time.Second,
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = b.srv.Serve(tls.NewListener(l, cfg))
	}()
	t.Cleanup(func() {
		b.srv.Close()
		<-done
	})
	return b
}

// webhookHandler admits every object except one whose name starts with
// "deny-"; the denial message carries the name, so the client sees bytes
// that only the webhook could have produced.
func webhookHandler(reviews *atomic.Int64) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var review struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Request    struct {
				UID    string `json:"uid"`
				Name   string `json:"name"`
				Object struct {
					Metadata struct {
						Name string `json:"name"`
					} `json:"metadata"`
				} `json:"object"`
			} `json:"request"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&review); err != nil || review.Kind != "AdmissionReview" {
			http.Error(w, "not an AdmissionReview", http.StatusBadRequest)
			return
		}
		reviews.Add(1)
		name := review.Request.Object.Metadata.Name
		resp := map[string]any{"uid": review.Request.UID, "allowed": true}
		if strings.HasPrefix(name, "deny-") {
			resp["allowed"] = false
			resp["status"] = map[string]any{"code": 403, "message": "e2e webhook denies " + name}
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{
			"apiVersion": review.APIVersion,
			"kind":       "AdmissionReview",
			"response":   resp,
		})
	})
}

// kubeletStandIn answers the kubelet API paths kube-apiserver proxies to:
// containerLogs (whole and follow=true), and exec and portForward, which
// it upgrades and then echoes every byte (enough to prove an upgraded
// connection carries bytes both ways; it does not speak SPDY frames).
type kubeletStandIn struct {
	mu       sync.Mutex
	requests []string // request URIs, in order
}

// kubeLogLines is the whole log the stand-in serves.
func kubeLogLines() string {
	var b strings.Builder
	for i := range 2000 {
		fmt.Fprintf(&b, "log line %04d konnectivity kube e2e\n", i)
	}
	return b.String()
}

func (k *kubeletStandIn) seen() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]string(nil), k.requests...)
}

func (k *kubeletStandIn) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	k.mu.Lock()
	k.requests = append(k.requests, r.Method+" "+r.URL.RequestURI())
	k.mu.Unlock()
	switch {
	case strings.HasPrefix(r.URL.Path, "/containerLogs/"):
		w.Header().Set("Content-Type", "text/plain")
		if r.URL.Query().Get("follow") != "true" {
			_, _ = io.WriteString(w, kubeLogLines())
			return
		}
		// A followed log: one numbered line every 100ms until the client
		// goes away or 30s pass.
		f, _ := w.(http.Flusher)
		for i := 0; i < 300; i++ {
			if _, err := fmt.Fprintf(w, "follow %d\n", i); err != nil {
				return
			}
			if f != nil {
				f.Flush()
			}
			select {
			case <-r.Context().Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	case strings.HasPrefix(r.URL.Path, "/exec/") && strings.HasSuffix(r.URL.Path, "/"+kubeExecContainer):
		serveSPDYExec(w, r)
	case r.URL.Path == "/portForward/"+kubeNS+"/"+kubeForwardPod:
		serveSPDYPortForward(w, r)
	case strings.HasPrefix(r.URL.Path, "/exec/"), strings.HasPrefix(r.URL.Path, "/portForward/"):
		if !strings.EqualFold(r.Header.Get("Connection"), "Upgrade") && !strings.Contains(strings.ToLower(r.Header.Get("Connection")), "upgrade") {
			http.Error(w, "upgrade required", http.StatusBadRequest)
			return
		}
		hj, ok := w.(http.Hijacker)
		if !ok {
			http.Error(w, "no hijack", http.StatusInternalServerError)
			return
		}
		c, brw, err := hj.Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		proto := r.Header.Get("X-Stream-Protocol-Version")
		if i := strings.IndexByte(proto, ','); i >= 0 {
			proto = proto[:i]
		}
		fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\nX-Stream-Protocol-Version: %s\r\n\r\n",
			r.Header.Get("Upgrade"), strings.TrimSpace(proto))
		if err := brw.Flush(); err != nil {
			return
		}
		_ = c.SetDeadline(time.Now().Add(time.Minute))
		_, _ = io.Copy(c, brw.Reader)
	default:
		http.NotFound(w, r)
	}
}

const (
	aggGroup   = "e2e.konnectivity.test"
	aggVersion = "v1"
)

// aggregatedHandler is a minimal aggregated API server: discovery for
// e2e.konnectivity.test/v1 and an echo of every other path under it.
func aggregatedHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/apis/" + aggGroup + "/" + aggVersion:
			_ = json.NewEncoder(w).Encode(map[string]any{
				"kind":         "APIResourceList",
				"apiVersion":   "v1",
				"groupVersion": aggGroup + "/" + aggVersion,
				"resources": []map[string]any{{
					"name": "echoes", "singularName": "echo", "namespaced": true,
					"kind": "Echo", "verbs": []string{"get"},
				}},
			})
		default:
			if !strings.HasPrefix(r.URL.Path, "/apis/"+aggGroup+"/") {
				http.NotFound(w, r)
				return
			}
			_ = json.NewEncoder(w).Encode(map[string]any{
				"kind":       "Echo",
				"apiVersion": aggGroup + "/" + aggVersion,
				"metadata":   map[string]any{"name": r.URL.Path[strings.LastIndexByte(r.URL.Path, '/')+1:]},
				"path":       r.URL.Path,
				"user":       r.Header.Get("X-Remote-User"),
			})
		}
	})
}

// upgradeEcho opens an upgraded connection to the apiserver at path
// (exec or portforward), sends n random-ish bytes in chunks and reads them
// back, both directions concurrently. It returns the status line when the
// apiserver did not switch protocols.
func upgradeEcho(c *kubeCluster, path, proto string, n int) error {
	host := strings.TrimPrefix(c.url, "https://")
	d := &tls.Dialer{Config: c.adminTLS, NetDialer: &net.Dialer{Timeout: 10 * time.Second}}
	conn, err := d.Dial("tcp", host)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
	fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: %s\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: %s\r\nContent-Length: 0\r\n\r\n", path, host, proto)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return fmt.Errorf("read upgrade response: %w", err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		return &upgradeRefused{code: resp.StatusCode, body: string(body)}
	}
	want := pattern(n)
	werr := make(chan error, 1)
	go func() {
		for off := 0; off < n; off += 16 << 10 {
			end := min(off+16<<10, n)
			if _, err := conn.Write(want[off:end]); err != nil {
				werr <- err
				return
			}
		}
		werr <- nil
	}()
	got := make([]byte, n)
	if _, err := io.ReadFull(br, got); err != nil {
		return fmt.Errorf("read echo: %w (write: %v)", err, <-werr)
	}
	if err := <-werr; err != nil {
		return fmt.Errorf("write: %w", err)
	}
	if sha(got) != sha(want) {
		return fmt.Errorf("echo of %d bytes differs: sha %s, want %s", n, sha(got), sha(want))
	}
	return nil
}

type upgradeRefused struct {
	code int
	body string
}

func (e *upgradeRefused) Error() string {
	return "upgrade refused: status " + strconv.Itoa(e.code) + ": " + e.body
}

// upgradeSPDY answers r as a kubelet answers an exec or port-forward:
// the protocol handshake, then the upgrade to SPDY; the streams the client
// opens arrive on streams. conn is nil when either step failed (the client
// has its answer then).
func upgradeSPDY(w http.ResponseWriter, r *http.Request, protocol string) (conn httpstream.Connection, streams <-chan httpstream.Stream) {
	if _, err := httpstream.Handshake(r, w, []string{protocol}); err != nil {
		return nil, nil
	}
	ch := make(chan httpstream.Stream, 8)
	conn = spdy.NewResponseUpgrader().UpgradeResponse(w, r, func(s httpstream.Stream, _ <-chan struct{}) error {
		ch <- s
		return nil
	})
	return conn, ch
}

// kubeExecContainer is the container whose exec the stand-in serves as a
// kubelet does: SPDY streams of the channel.k8s.io protocols, here a `cat`
// (stdin copied to stdout, then a success status on the error stream).
const kubeExecContainer = "shell"

func serveSPDYExec(w http.ResponseWriter, r *http.Request) {
	conn, streams := upgradeSPDY(w, r, "v4.channel.k8s.io")
	if conn == nil {
		return
	}
	defer conn.Close()
	byType := map[string]httpstream.Stream{}
	timeout := time.After(10 * time.Second)
	for byType[corev1.StreamTypeError] == nil || byType[corev1.StreamTypeStdin] == nil || byType[corev1.StreamTypeStdout] == nil {
		select {
		case s := <-streams:
			byType[s.Headers().Get(corev1.StreamType)] = s
		case <-timeout:
			return
		}
	}
	_, _ = io.Copy(byType[corev1.StreamTypeStdout], byType[corev1.StreamTypeStdin])
	byType[corev1.StreamTypeStdout].Close()
	_ = json.NewEncoder(byType[corev1.StreamTypeError]).Encode(map[string]any{
		"kind": "Status", "apiVersion": "v1", "status": "Success",
	})
	byType[corev1.StreamTypeError].Close()
}

// kubeForwardPod is the Pod whose port-forward the stand-in serves as a
// kubelet does (portforward.k8s.io SPDY streams), echoing every data
// stream whatever its port.
const kubeForwardPod = "fwd"

func serveSPDYPortForward(w http.ResponseWriter, r *http.Request) {
	conn, streams := upgradeSPDY(w, r, "portforward.k8s.io")
	if conn == nil {
		return
	}
	defer conn.Close()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		select {
		case s := <-streams:
			if s.Headers().Get(corev1.StreamType) != corev1.StreamTypeData {
				continue // the error stream stays open, unused
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _ = io.Copy(s, s)
				s.Close()
			}()
		case <-conn.CloseChan():
			return
		case <-time.After(time.Minute):
			return
		}
	}
}
