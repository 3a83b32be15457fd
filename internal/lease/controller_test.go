package lease

import (
	"bytes"
	"context"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/internal/kubeclient"
	"github.com/spinifex/konnectivity/internal/promtext"
)

const testNS = "kube-system"

var testLabels = map[string]string{"k8s-app": "konnectivity-server"}

// waitFake waits until cond holds, re-checking whenever the fake's store
// changes (and every 50ms, for conditions on metrics or logs).
func waitFake(t *testing.T, f *fakeAPI, what string, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(30 * time.Second) // a 10,001-Lease list under -race on a busy machine
	defer deadline.Stop()
	for {
		f.mu.Lock()
		changed := f.changed
		f.mu.Unlock()
		if cond() {
			return
		}
		select {
		case <-changed:
		case <-time.After(50 * time.Millisecond):
		case <-deadline.C:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func writeToken(t *testing.T, path, token string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func newTestClient(t *testing.T) (*fakeAPI, *Client, string) {
	t.Helper()
	f := newFakeAPI(t, "token-1")
	tokenFile := filepath.Join(t.TempDir(), "token")
	writeToken(t, tokenFile, "token-1")
	c, err := NewClient(f.restConfig(t, tokenFile), testNS)
	if err != nil {
		t.Fatal(err)
	}
	return f, c, tokenFile
}

// syncBuffer is a log sink safe for concurrent writers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) count(sub string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Count(s.b.String(), sub)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type runningController struct {
	c    *Controller
	m    *promtext.Registry
	logs *syncBuffer
	stop func()
}

func startController(t *testing.T, client *Client, id string, mod func(*ControllerConfig)) *runningController {
	t.Helper()
	logs := &syncBuffer{}
	m := promtext.NewRegistry()
	cfg := ControllerConfig{
		Client: client, ServerID: id, Labels: testLabels,
		Duration: 2 * time.Second, RenewInterval: 100 * time.Millisecond, GCInterval: 100 * time.Millisecond,
		Metrics: m, Logger: slog.New(slog.NewTextHandler(logs, nil)),
	}
	if mod != nil {
		mod(&cfg)
	}
	c, err := NewController(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx) }()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return &runningController{c: c, m: m, logs: logs, stop: stop}
}

func metricsText(m *promtext.Registry) string {
	var b strings.Builder
	m.WriteText(&b)
	return b.String()
}

func TestControllerCreatesRenewsAndReleases(t *testing.T) {
	checkNoLeaks(t)
	f, client, _ := newTestClient(t)
	rc := startController(t, client, "server-a", nil)
	name := "konnectivity-proxy-server-server-a"
	if rc.c.Name() != name {
		t.Fatalf("lease name %q, want %q", rc.c.Name(), name)
	}
	var first *Lease
	waitFake(t, f, "the lease to be created", func() bool { first, _ = f.get(testNS, name); return first != nil })
	if first.Holder != "server-a" || first.Duration != 2*time.Second || first.Labels["k8s-app"] != "konnectivity-server" || len(first.Labels) != 1 {
		t.Fatalf("created lease: holder %q duration %s labels %v", first.Holder, first.Duration, first.Labels)
	}
	if first.RenewTime.IsZero() || time.Since(first.RenewTime) > 5*time.Second {
		t.Fatalf("renewTime %v is not now", first.RenewTime)
	}
	// Somebody annotates the Lease: renewals keep what they do not own.
	obj := leaseObject(name, "server-a", testLabels, first.RenewTime, 2)
	obj["metadata"].(map[string]any)["annotations"] = map[string]any{"note": "kept"}
	f.put(testNS, obj)
	var renewed *Lease
	waitFake(t, f, "a renewal", func() bool {
		renewed, _ = f.get(testNS, name)
		return renewed != nil && renewed.RenewTime.After(first.RenewTime) && renewed.Holder == "server-a"
	})
	if !strings.Contains(string(renewed.raw), `"note":"kept"`) {
		t.Fatalf("renewal dropped the annotation: %s", renewed.raw)
	}
	if f.requests(http.MethodPut) == 0 {
		t.Fatal("no update was sent")
	}

	rc.stop()
	if err := rc.c.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, ok := f.get(testNS, name); ok {
		t.Fatal("lease still exists after Release")
	}
	if err := rc.c.Release(context.Background()); err != nil {
		t.Fatalf("second Release: %v", err)
	}
	if !strings.Contains(metricsText(rc.m), `konnectivity_network_proxy_server_lease_renewals_total{result="success"}`) {
		t.Fatalf("no renewal metric:\n%s", metricsText(rc.m))
	}
}

func TestControllerRecreatesDeletedLease(t *testing.T) {
	f, client, _ := newTestClient(t)
	startController(t, client, "server-a", nil)
	name := NamePrefix + "server-a"
	waitFake(t, f, "the lease", func() bool { _, ok := f.get(testNS, name); return ok })
	creates := f.requests(http.MethodPost)
	f.remove(testNS, name)
	waitFake(t, f, "the lease to come back", func() bool { _, ok := f.get(testNS, name); return ok })
	if got := f.requests(http.MethodPost); got != creates+1 {
		t.Fatalf("creates: %d, want %d", got, creates+1)
	}
}

func TestControllerCullsExpiredLeases(t *testing.T) {
	checkNoLeaks(t)
	f, client, _ := newTestClient(t)
	now := time.Now()
	f.put(testNS, leaseObject(NamePrefix+"dead", "dead", testLabels, now.Add(-time.Minute), 30))
	f.put(testNS, leaseObject(NamePrefix+"alive", "alive", testLabels, now, 30))
	f.put(testNS, leaseObject("other-expired", "x", map[string]string{"app": "other"}, now.Add(-time.Minute), 30))
	noTimes := leaseObject(NamePrefix+"no-times", "nt", testLabels, now, 30)
	delete(noTimes["spec"].(map[string]any), "renewTime")
	f.put(testNS, noTimes)

	rc := startController(t, client, "server-a", nil)
	waitFake(t, f, "the expired leases to be culled", func() bool {
		_, dead := f.get(testNS, NamePrefix+"dead")
		_, nt := f.get(testNS, NamePrefix+"no-times")
		return !dead && !nt
	})
	for _, keep := range []string{NamePrefix + "alive", "other-expired", NamePrefix + "server-a"} {
		waitFake(t, f, keep, func() bool { _, ok := f.get(testNS, keep); return ok })
	}
	waitFake(t, f, "the culls to be counted", func() bool {
		return strings.Contains(metricsText(rc.m), "konnectivity_network_proxy_server_culled_leases_count 2\n")
	})
	text := metricsText(rc.m)
	for _, want := range []string{
		`konnectivity_network_proxy_server_lease_delete_total{http_status_code="200",reason=""} 2`,
		`konnectivity_network_proxy_server_lease_list_total{http_status_code="200",reason=""}`,
		`konnectivity_network_proxy_server_lease_list_latency_seconds_bucket{http_status_code="200",le="0.005"}`,
		`konnectivity_network_proxy_server_lease_delete_latency_seconds_count{http_status_code="200"} 2`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("metrics lack %q:\n%s", want, text)
		}
	}
	if n := rc.logs.count("culled expired server lease"); n != 2 {
		t.Errorf("%d cull log lines, want 2:\n%s", n, rc.logs)
	}
}

// A Lease renewed between the list and the delete is not culled: the
// delete's resourceVersion precondition fails.
func TestControllerCullSparesRenewedLease(t *testing.T) {
	f, client, _ := newTestClient(t)
	name := NamePrefix + "slow"
	f.put(testNS, leaseObject(name, "slow", testLabels, time.Now().Add(-time.Minute), 30))
	var once sync.Once
	f.setFail(func(r *http.Request) (int, string) {
		if r.Method == http.MethodDelete && strings.HasSuffix(r.URL.Path, "/"+name) {
			once.Do(func() { f.put(testNS, leaseObject(name, "slow", testLabels, time.Now(), 30)) })
		}
		return 0, ""
	})
	rc := startController(t, client, "server-a", nil)
	waitFake(t, f, "a conflicting delete", func() bool {
		return strings.Contains(metricsText(rc.m), `lease_delete_total{http_status_code="409",reason="Conflict"} 1`)
	})
	if _, ok := f.get(testNS, name); !ok {
		t.Fatal("the renewed lease was deleted")
	}
	if strings.Contains(metricsText(rc.m), "culled_leases_count 1") {
		t.Fatal("a spared lease was counted as culled")
	}
}

// API failures are retried and logged once, never fatal; the recovery is
// logged once too.
func TestControllerLogsFailuresOnce(t *testing.T) {
	checkNoLeaks(t)
	f, client, _ := newTestClient(t)
	f.setFail(func(*http.Request) (int, string) { return http.StatusServiceUnavailable, "ServiceUnavailable" })
	rc := startController(t, client, "server-a", nil)
	waitFake(t, f, "several failed attempts", func() bool { return f.requests(http.MethodGet) >= 4 && f.requests("LIST") >= 4 })
	if n := rc.logs.count("renew server lease failed"); n != 1 {
		t.Fatalf("%d renewal failure lines, want 1:\n%s", n, rc.logs)
	}
	if n := rc.logs.count("cull expired server leases failed"); n != 1 {
		t.Fatalf("%d cull failure lines, want 1:\n%s", n, rc.logs)
	}
	if !strings.Contains(metricsText(rc.m), `lease_list_total{http_status_code="503",reason="ServiceUnavailable"}`) {
		t.Fatalf("failed lists not counted:\n%s", metricsText(rc.m))
	}
	f.setFail(nil)
	waitFake(t, f, "the lease after recovery", func() bool { _, ok := f.get(testNS, NamePrefix+"server-a"); return ok })
	waitFake(t, f, "the recovery line", func() bool { return rc.logs.count("renew server lease: working again") == 1 })
}

// The token file is read for every call, so a rotated ServiceAccount token
// is used as soon as it is on disk.
func TestClientRereadsRotatedToken(t *testing.T) {
	f, client, tokenFile := newTestClient(t)
	ctx := context.Background()
	if _, _, err := client.List(ctx, ""); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	f.token = "token-2"
	f.mu.Unlock()
	if _, _, err := client.List(ctx, ""); !kubeapi.IsCode(err, http.StatusUnauthorized) {
		t.Fatalf("old token: err %v, want 401", err)
	}
	writeToken(t, tokenFile, "token-2")
	if _, _, err := client.List(ctx, ""); err != nil {
		t.Fatalf("rotated token: %v", err)
	}
}

func TestClientErrors(t *testing.T) {
	f, client, _ := newTestClient(t)
	ctx := context.Background()
	_, err := client.Get(ctx, "missing")
	if code, reason, ok := kubeapi.Status(err); !ok || code != 404 || reason != "NotFound" {
		t.Fatalf("get missing: %v", err)
	}
	if err := client.Delete(ctx, "missing", ""); !kubeapi.IsCode(err, 404) {
		t.Fatalf("delete missing: %v", err)
	}
	l := &Lease{Name: "x", Namespace: testNS, Holder: "h", Duration: time.Second, RenewTime: time.Now()}
	if _, err := client.Create(ctx, l); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Create(ctx, l); !kubeapi.IsCode(err, http.StatusConflict) {
		t.Fatalf("second create: %v", err)
	}
	stale := &Lease{Name: "x", ResourceVersion: "999", Holder: "h", Duration: time.Second, RenewTime: time.Now()}
	if _, err := client.Update(ctx, stale); !kubeapi.IsCode(err, http.StatusConflict) {
		t.Fatalf("stale update: %v", err)
	}
	// A body that is not a Status still yields client-go's reason.
	f.setFail(func(*http.Request) (int, string) { return 0, "" })
	if e := kubeapi.DecodeStatus(http.StatusForbidden, []byte("<html>nope</html>")); e.Reason != "Forbidden" || e.Code != 403 {
		t.Fatalf("non-Status body: %+v", e)
	}
	if _, err := NewClient(client0(t, f), "Bad_NS"); err == nil {
		t.Fatal("invalid namespace accepted")
	}
}

func client0(t *testing.T, f *fakeAPI) *kubeclient.Config {
	tokenFile := filepath.Join(t.TempDir(), "token")
	writeToken(t, tokenFile, "token-1")
	return f.restConfig(t, tokenFile)
}

func TestNewControllerChecks(t *testing.T) {
	_, client, _ := newTestClient(t)
	for _, cfg := range []ControllerConfig{
		{Client: client, ServerID: "Upper_Case", Labels: testLabels},
		{Client: client, ServerID: "ok"},
		{Client: client, ServerID: "ok", Labels: testLabels, Duration: 10 * time.Second, RenewInterval: 10 * time.Second},
		{ServerID: "ok", Labels: testLabels},
	} {
		if _, err := NewController(cfg); err == nil {
			t.Errorf("NewController(%+v) accepted", cfg)
		}
	}
}
