package lease

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// rawClient is a Client for an apiserver that answers with handler.
func rawClient(t *testing.T, handler http.HandlerFunc) *Client {
	t.Helper()
	f := &fakeAPI{}
	f.srv = httptest.NewTLSServer(handler)
	t.Cleanup(f.srv.Close)
	tokenFile := filepath.Join(t.TempDir(), "token")
	writeToken(t, tokenFile, "t")
	c, err := NewClient(f.restConfig(t, tokenFile), testNS)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Answers are bounded: a list, an object or one watch event larger than
// its limit is an error, not an allocation of whatever the peer sends.
func TestClientBoundsAnswers(t *testing.T) {
	ctx := context.Background()
	huge := func(w io.Writer, n int) {
		chunk := strings.Repeat("x", 64<<10)
		for i := 0; i < n/len(chunk)+1; i++ {
			io.WriteString(w, chunk)
		}
	}
	c := rawClient(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		switch {
		case r.URL.Query().Get("watch") == "true":
			io.WriteString(w, `{"type":"ADDED","object":{"metadata":{"name":"`)
			huge(w, maxObjectSize)
			io.WriteString(w, `"}}}`)
		case strings.HasSuffix(r.URL.Path, "/leases"):
			io.WriteString(w, `{"items":[{"metadata":{"name":"`)
			huge(w, maxListSize)
			io.WriteString(w, `"}}]}`)
		default:
			io.WriteString(w, `{"metadata":{"name":"`)
			huge(w, maxObjectSize)
			io.WriteString(w, `"}}`)
		}
	})
	if _, _, err := c.List(ctx, ""); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("huge list: %v", err)
	}
	if _, err := c.Get(ctx, "x"); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("huge object: %v", err)
	}
	events, werr, err := c.Watch(ctx, "", "1", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	for range events {
		t.Error("an event arrived")
	}
	if err := werr(); err == nil || !strings.Contains(err.Error(), "larger than 1 MiB") {
		t.Errorf("huge watch event: %v", err)
	}
}

// A watch whose apiserver never ends it is ended by the client's own
// deadline, and cancelling the context ends it at once.
func TestClientWatchEnds(t *testing.T) {
	checkNoLeaks(t)
	hold := make(chan struct{})
	defer close(hold)
	c := rawClient(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select {
		case <-hold:
		case <-r.Context().Done():
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	events, werr, err := c.Watch(ctx, "", "1", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case _, open := <-events:
		if open {
			t.Fatal("an event arrived")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("watch did not end on cancel")
	}
	if err := werr(); err != nil {
		t.Fatalf("cancelled watch: %v", err)
	}
}

func TestEncodeKeepsUnknownFields(t *testing.T) {
	raw := []byte(`{"apiVersion":"coordination.k8s.io/v1","kind":"Lease","metadata":{"name":"n","resourceVersion":"5","ownerReferences":[{"name":"o"}],"labels":{"old":"x"}},"spec":{"holderIdentity":"h","leaseDurationSeconds":30,"leaseTransitions":2}}`)
	l, err := decodeLease(raw)
	if err != nil {
		t.Fatal(err)
	}
	l.Labels = map[string]string{"k8s-app": "konnectivity-server"}
	l.RenewTime = time.Date(2026, 1, 2, 3, 4, 5, 600000000, time.UTC)
	out, err := l.encode()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"ownerReferences":[{"name":"o"}]`, `"leaseTransitions":2`, `"renewTime":"2026-01-02T03:04:05.600000Z"`, `"labels":{"k8s-app":"konnectivity-server"}`, `"resourceVersion":"5"`} {
		if !strings.Contains(string(out), want) {
			t.Errorf("encoded lease lacks %s: %s", want, out)
		}
	}
	if strings.Contains(string(out), `"old"`) {
		t.Errorf("labels were merged, not replaced: %s", out)
	}
}
