package lease

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
)

type runningCounter struct {
	c       *Counter
	m       *promtext.Registry
	logs    *syncBuffer
	changes chan int
}

func startCounter(t *testing.T, client *Client, sel string, mod func(*CounterConfig)) *runningCounter {
	t.Helper()
	s, err := ParseSelector(sel)
	if err != nil {
		t.Fatal(err)
	}
	rc := &runningCounter{m: promtext.NewRegistry(), logs: &syncBuffer{}, changes: make(chan int, 100)}
	cfg := CounterConfig{
		Client: client, Selector: s, PollInterval: 100 * time.Millisecond,
		OnChange: func(n int) { rc.changes <- n },
		Metrics:  rc.m, Logger: slog.New(slog.NewTextHandler(rc.logs, nil)),
	}
	if mod != nil {
		mod(&cfg)
	}
	if rc.c, err = NewCounter(cfg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); rc.c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return rc
}

// next waits for the next reported count.
func (rc *runningCounter) next(t *testing.T, want int, within time.Duration) {
	t.Helper()
	select {
	case n := <-rc.changes:
		if n != want {
			t.Fatalf("count %d, want %d", n, want)
		}
	case <-time.After(within):
		t.Fatalf("no count within %s (want %d); current %d", within, want, rc.c.Count())
	}
}

func (rc *runningCounter) quiet(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case n := <-rc.changes:
		t.Fatalf("unexpected count change to %d", n)
	case <-time.After(d):
	}
}

func TestCounterFollowsLeases(t *testing.T) {
	checkNoLeaks(t)
	f, client, _ := newTestClient(t)
	now := time.Now()
	f.put(testNS, leaseObject(NamePrefix+"a", "a", testLabels, now, 30))
	f.put(testNS, leaseObject(NamePrefix+"b", "b", testLabels, now, 30))
	f.put(testNS, leaseObject(NamePrefix+"expired", "x", testLabels, now.Add(-time.Minute), 30))
	f.put(testNS, leaseObject("other", "o", map[string]string{"k8s-app": "other"}, now, 30))
	f.put("elsewhere", leaseObject(NamePrefix+"c", "c", testLabels, now, 30))

	rc := startCounter(t, client, "k8s-app=konnectivity-server", nil)
	rc.next(t, 2, 5*time.Second)
	if rc.c.Count() != 2 {
		t.Fatalf("Count() = %d", rc.c.Count())
	}
	// Changes arrive through the watch, without listing again.
	lists := f.requests("LIST")
	f.put(testNS, leaseObject(NamePrefix+"c", "c", testLabels, time.Now(), 30))
	rc.next(t, 3, 2*time.Second)
	f.remove(testNS, NamePrefix+"a")
	rc.next(t, 2, 2*time.Second)
	// A renewal changes nothing; a label change takes a Lease out.
	f.put(testNS, leaseObject(NamePrefix+"b", "b", testLabels, time.Now(), 30))
	f.put(testNS, leaseObject(NamePrefix+"c", "c", map[string]string{"k8s-app": "moved"}, time.Now(), 30))
	rc.next(t, 1, 2*time.Second)
	// No Lease left: upstream's floor of one server.
	f.remove(testNS, NamePrefix+"b")
	rc.quiet(t, 200*time.Millisecond)
	if got := f.requests("LIST"); got != lists {
		t.Fatalf("%d lists after the first, want 0 (watch)", got-lists)
	}
	if f.requests("WATCH") < 1 {
		t.Fatal("no watch")
	}
	text := metricsText(rc.m)
	for _, want := range []string{
		`konnectivity_network_proxy_agent_lease_lists_total{http_response_code="200",reason=""} 1`,
		`konnectivity_network_proxy_agent_lease_watches_total{http_response_code="200",reason=""}`,
		`konnectivity_network_proxy_agent_lease_list_latency_seconds_bucket{http_response_code="200",le="30"} 1`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("metrics lack %q:\n%s", want, text)
		}
	}
}

// A Lease that is not renewed stops counting when it runs out, though no
// watch event says so.
func TestCounterExpiresLeases(t *testing.T) {
	f, client, _ := newTestClient(t)
	now := time.Now()
	f.put(testNS, leaseObject(NamePrefix+"a", "a", testLabels, now, 30))
	// Valid for about 700ms more.
	f.put(testNS, leaseObject(NamePrefix+"b", "b", testLabels, now.Add(-29300*time.Millisecond), 30))
	rc := startCounter(t, client, "k8s-app=konnectivity-server", nil)
	rc.next(t, 2, 5*time.Second)
	start := time.Now()
	rc.next(t, 1, 5*time.Second)
	if late := time.Since(start); late > 3*time.Second {
		t.Fatalf("expiry noticed after %s", late)
	}
	// The expiry was confirmed by a second list, not by an event.
	if n := f.requests("LIST"); n != 2 {
		t.Fatalf("%d lists, want 2 (start, expiry)", n)
	}
	// Renewed again: counted again.
	f.put(testNS, leaseObject(NamePrefix+"b", "b", testLabels, time.Now(), 30))
	rc.next(t, 2, 2*time.Second)
}

// A watch from a compacted resourceVersion (410) leads to a new list.
func TestCounterRelistsAfterGone(t *testing.T) {
	checkNoLeaks(t)
	f, client, _ := newTestClient(t)
	f.put(testNS, leaseObject(NamePrefix+"a", "a", testLabels, time.Now(), 30))
	var mu sync.Mutex
	first := true
	f.setFail(func(r *http.Request) (int, string) {
		// Compact just before the first watch arrives.
		mu.Lock()
		defer mu.Unlock()
		if r.URL.Query().Get("watch") == "true" && first {
			first = false
			f.compact()
		}
		return 0, ""
	})
	rc := startCounter(t, client, "k8s-app=konnectivity-server", nil)
	rc.next(t, 1, 5*time.Second)
	waitFake(t, f, "a second list", func() bool { return f.requests("LIST") >= 2 })
	f.put(testNS, leaseObject(NamePrefix+"b", "b", testLabels, time.Now(), 30))
	rc.next(t, 2, 5*time.Second)
}

// Without the watch verb the counter falls back to listing every poll
// interval, and says so once.
func TestCounterPollsWhenWatchForbidden(t *testing.T) {
	checkNoLeaks(t)
	f, client, _ := newTestClient(t)
	f.put(testNS, leaseObject(NamePrefix+"a", "a", testLabels, time.Now(), 30))
	f.failWatches(http.StatusForbidden, "Forbidden")
	rc := startCounter(t, client, "k8s-app=konnectivity-server", nil)
	rc.next(t, 1, 5*time.Second)
	f.put(testNS, leaseObject(NamePrefix+"b", "b", testLabels, time.Now(), 30))
	rc.next(t, 2, 5*time.Second)
	waitFake(t, f, "several lists", func() bool { return f.requests("LIST") >= 4 })
	if n := rc.logs.count("watch server leases (listing again every poll interval instead) failed"); n != 1 {
		t.Fatalf("%d watch failure lines, want 1:\n%s", n, rc.logs)
	}
	if !strings.Contains(metricsText(rc.m), `lease_watches_total{http_response_code="403",reason="Forbidden"}`) {
		t.Fatalf("forbidden watches not counted:\n%s", metricsText(rc.m))
	}
}

// An apiserver that fails keeps the last count; the count is unknown (0)
// until a list succeeds.
func TestCounterKeepsCountThroughFailures(t *testing.T) {
	f, client, _ := newTestClient(t)
	f.put(testNS, leaseObject(NamePrefix+"a", "a", testLabels, time.Now(), 30))
	f.put(testNS, leaseObject(NamePrefix+"b", "b", testLabels, time.Now(), 30))
	f.setFail(func(*http.Request) (int, string) { return http.StatusInternalServerError, "InternalError" })
	rc := startCounter(t, client, "k8s-app=konnectivity-server", nil)
	waitFake(t, f, "failed lists", func() bool { return f.requests("LIST") >= 3 })
	if rc.c.Count() != 0 {
		t.Fatalf("count %d before any list succeeded", rc.c.Count())
	}
	if n := rc.logs.count("count server leases failed"); n != 1 {
		t.Fatalf("%d failure lines, want 1:\n%s", n, rc.logs)
	}
	f.setFail(nil)
	rc.next(t, 2, 5*time.Second)
	if !strings.Contains(metricsText(rc.m), `lease_lists_total{http_response_code="500",reason="InternalError"}`) {
		t.Fatalf("failed lists not counted:\n%s", metricsText(rc.m))
	}
}

func TestLeaseValidity(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		l    Lease
		want bool
	}{
		{Lease{RenewTime: now.Add(-29 * time.Second), Duration: 30 * time.Second}, true},
		{Lease{RenewTime: now.Add(-30 * time.Second), Duration: 30 * time.Second}, false}, // expiry == now is expired
		{Lease{AcquireTime: now, Duration: 30 * time.Second}, true},
		{Lease{AcquireTime: now, RenewTime: now.Add(-time.Minute), Duration: 30 * time.Second}, false},
		{Lease{Duration: 30 * time.Second}, false},
		{Lease{RenewTime: now}, false},
	} {
		if got := tc.l.Valid(now); got != tc.want {
			t.Errorf("%+v: Valid = %v, want %v", tc.l, got, tc.want)
		}
	}
}

// A watch that silently stops delivering events does not make renewed
// Leases look expired: at the expiry the Counter lists again and sees the
// renewal.
func TestCounterSurvivesStaleWatch(t *testing.T) {
	f, client, _ := newTestClient(t)
	now := time.Now()
	f.put(testNS, leaseObject(NamePrefix+"a", "a", testLabels, now, 30))
	f.put(testNS, leaseObject(NamePrefix+"b", "b", testLabels, now.Add(-29500*time.Millisecond), 30))
	rc := startCounter(t, client, "k8s-app=konnectivity-server", nil)
	rc.next(t, 2, 5*time.Second)
	// The renewal of b happens, but the watch is muted (it was opened
	// before, and the fake only delivers what it records as events).
	f.mu.Lock()
	f.events = nil
	f.mu.Unlock()
	obj := leaseObject(NamePrefix+"b", "b", testLabels, time.Now(), 30)
	f.mu.Lock()
	key := testNS + "/" + NamePrefix + "b"
	obj["metadata"].(map[string]any)["namespace"] = testNS
	f.rv++
	obj["metadata"].(map[string]any)["resourceVersion"] = strconv.FormatInt(f.rv, 10)
	obj["apiVersion"], obj["kind"] = "coordination.k8s.io/v1", "Lease"
	f.objects[key] = obj // stored without an event
	f.mu.Unlock()
	waitFake(t, f, "the relist at b's old expiry", func() bool { return f.requests("LIST") >= 2 })
	rc.quiet(t, 300*time.Millisecond)
	if rc.c.Count() != 2 {
		t.Fatalf("count %d, want 2", rc.c.Count())
	}
}

// With the apiserver gone, a Lease that runs out stops counting all the
// same (the last view is recounted), as upstream's cache does.
func TestCounterExpiresDuringOutage(t *testing.T) {
	f, client, _ := newTestClient(t)
	now := time.Now()
	f.put(testNS, leaseObject(NamePrefix+"a", "a", testLabels, now, 30))
	f.put(testNS, leaseObject(NamePrefix+"b", "b", testLabels, now.Add(-29500*time.Millisecond), 30))
	rc := startCounter(t, client, "k8s-app=konnectivity-server", nil)
	rc.next(t, 2, 5*time.Second)
	f.setFail(func(r *http.Request) (int, string) {
		if r.URL.Query().Get("watch") != "true" {
			return http.StatusServiceUnavailable, "ServiceUnavailable"
		}
		return 0, ""
	})
	rc.next(t, 1, 5*time.Second)
	if n := rc.logs.count("count server leases failed"); n != 1 {
		t.Fatalf("%d failure lines, want 1:\n%s", n, rc.logs)
	}
}

// A selector that matches far more Leases than any set of servers is
// refused with a clear error, not tracked without bound.
func TestCounterBoundsTrackedLeases(t *testing.T) {
	f, client, _ := newTestClient(t)
	now := time.Now()
	for i := range maxLeases + 1 {
		f.put(testNS, leaseObject(fmt.Sprintf("l-%d", i), "h", testLabels, now, 30))
	}
	rc := startCounter(t, client, "k8s-app=konnectivity-server", nil)
	waitFake(t, f, "the refusal", func() bool { return rc.logs.count("more than 10000 is not a konnectivity deployment") == 1 })
	if rc.c.Count() != 0 {
		t.Fatalf("count %d from an oversized list", rc.c.Count())
	}
}

// An apiserver that answers every watch with 410 is not called in a tight
// loop: lists and watches are each at least a second apart.
func TestCounterPacesCalls(t *testing.T) {
	f, client, _ := newTestClient(t)
	f.put(testNS, leaseObject(NamePrefix+"a", "a", testLabels, time.Now(), 30))
	f.failWatches(http.StatusGone, "Expired")
	start := time.Now()
	rc := startCounter(t, client, "k8s-app=konnectivity-server", nil)
	rc.next(t, 1, 5*time.Second)
	waitFake(t, f, "a third list", func() bool { return f.requests("LIST") >= 3 })
	el := time.Since(start)
	if lists := f.requests("LIST"); float64(lists) > el.Seconds()/minCallGap.Seconds()+1 {
		t.Fatalf("%d lists in %v", lists, el)
	}
}
