package nodemap

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/testnet"
)

// startWatcher runs a Watcher on f until the test ends and waits for Run to
// return then.
func startWatcher(t *testing.T, server string, cfg Config) (*Watcher, *logRecorder) {
	t.Helper()
	rec := &logRecorder{}
	cfg.REST = restConfigFor(t, server)
	cfg.Logger = slog.New(rec)
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff = 10 * time.Millisecond
		cfg.MaxBackoff = 20 * time.Millisecond
	}
	w, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range w.kinds {
		f.c.page = 3 // several pages even for small lists
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return w, rec
}

// waitFor waits until cond holds, failing after 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func routesTo(tb *Table, host, node string) func() bool {
	return func() bool { n, _ := tb.Lookup(host); return n == node }
}

// Changes reach the table through the watch: after the first list, no
// other list happens while Nodes and EndpointSlices are added, changed and
// deleted.
func TestWatcherFollowsChanges(t *testing.T) {
	testnet.CheckNoLeaks(t)
	f := newFakeAPI(t)
	for i := range 7 {
		f.put(pathNodes, nodeObj(fmt.Sprintf("n%d", i), []string{fmt.Sprintf("192.168.0.%d", i)}, fmt.Sprintf("10.244.%d.0/24", i)))
	}
	f.put(pathSlices, sliceObj("default", "web-1", "172.31.5.5", "n3", "172.31.5.6", "n4"))
	w, rec := startWatcher(t, f.srv.URL, Config{})
	tb := w.Table()
	waitFor(t, "first list", w.Synced)
	checkLookups(t, tb, []lookupCase{
		{"192.168.0.6", "n6", NodeAddress},
		{"10.244.2.9", "n2", PodCIDR},
		{"172.31.5.5", "n3", PodAddress},
	})
	waitFor(t, "watches open", func() bool { return f.count("WATCH "+pathNodes) == 1 && f.count("WATCH "+pathSlices) == 1 })

	// A Node added.
	f.put(pathNodes, nodeObj("late", []string{"192.168.9.9", "fd00::9"}, "10.250.0.0/24", "fd10:250::/64"))
	waitFor(t, "added node", routesTo(tb, "fd10:250::1", "late"))
	// Its pod CIDR changed.
	f.put(pathNodes, nodeObj("late", []string{"192.168.9.9"}, "10.251.0.0/24"))
	waitFor(t, "changed pod CIDR", routesTo(tb, "10.251.0.1", "late"))
	checkLookups(t, tb, []lookupCase{{"10.250.0.1", "", NoMatch}, {"fd10:250::1", "", NoMatch}})
	// An EndpointSlice updated: the pod moved to another node.
	f.put(pathSlices, sliceObj("default", "web-1", "172.31.5.5", "late"))
	waitFor(t, "updated endpointslice", routesTo(tb, "172.31.5.5", "late"))
	checkLookups(t, tb, []lookupCase{{"172.31.5.6", "", NoMatch}})
	// A Node deleted takes its routes, pod addresses included.
	f.del(pathNodes, "late")
	waitFor(t, "deleted node", routesTo(tb, "192.168.9.9", ""))
	checkLookups(t, tb, []lookupCase{{"10.251.0.1", "", NoMatch}, {"172.31.5.5", "", NoMatch}})
	// An EndpointSlice deleted.
	f.del(pathSlices, "default/web-1")
	waitFor(t, "deleted endpointslice", func() bool { _, pods := tb.Size(); return pods == 0 })

	if n := f.count("LIST " + pathNodes); n != 3 { // 7 nodes in pages of 3
		t.Errorf("node list pages = %d, want 3 (the changes must come by watch)", n)
	}
	if w := rec.warnings(); len(w) != 0 {
		t.Errorf("warnings: %q", w)
	}
}

// A watch that cannot continue (410 Gone after a compaction) lists again,
// and the list drops what was deleted unseen.
func TestWatcherRelistsOnGone(t *testing.T) {
	testnet.CheckNoLeaks(t)
	f := newFakeAPI(t)
	f.put(pathNodes, nodeObj("a", []string{"192.168.0.1"}))
	f.put(pathNodes, nodeObj("b", []string{"192.168.0.2"}))
	w, rec := startWatcher(t, f.srv.URL, Config{})
	tb := w.Table()
	waitFor(t, "first list", w.Synced)
	waitFor(t, "watch open", func() bool { return f.count("WATCH "+pathNodes) == 1 })

	// b goes while the watch is down and its event is compacted away.
	f.mu.Lock()
	delete(f.objects, pathNodes+" b")
	f.mu.Unlock()
	f.compact()
	waitFor(t, "second list", func() bool { return f.count("LIST "+pathNodes) == 2 })
	waitFor(t, "b dropped", routesTo(tb, "192.168.0.2", ""))
	checkLookups(t, tb, []lookupCase{{"192.168.0.1", "a", NodeAddress}})
	// And the watch goes on from the new list.
	f.put(pathNodes, nodeObj("c", []string{"192.168.0.3"}))
	waitFor(t, "c added", routesTo(tb, "192.168.0.3", "c"))
	if w := rec.warnings(); len(w) != 0 {
		t.Errorf("a 410 is routine, yet warned: %q", w)
	}
}

// Missing RBAC is one warning however often the list is retried; the
// table stays empty, and fills once the RBAC is granted.
func TestWatcherForbiddenWarnsOnce(t *testing.T) {
	testnet.CheckNoLeaks(t)
	f := newFakeAPI(t)
	f.put(pathNodes, nodeObj("a", []string{"192.168.0.1"}))
	f.setFail(func(*http.Request) int { return http.StatusForbidden })
	w, rec := startWatcher(t, f.srv.URL, Config{})
	waitFor(t, "five retries", func() bool { return f.count("LIST "+pathNodes) >= 5 })
	var forbidden int
	for _, msg := range rec.warnings() {
		t.Log(msg)
		forbidden++
	}
	if forbidden != 2 { // one for nodes, one for endpointslices
		t.Errorf("warnings = %d, want one per kind", forbidden)
	}
	if n, _ := w.Table().Size(); n != 0 || w.Synced() {
		t.Errorf("table has %d nodes, synced %t; want empty", n, w.Synced())
	}
	f.setFail(nil)
	waitFor(t, "granted", routesTo(w.Table(), "192.168.0.1", "a"))
}

// An apiserver that cannot be reached is one warning, never a crash.
func TestWatcherUnreachableWarnsOnce(t *testing.T) {
	testnet.CheckNoLeaks(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var accepts atomic.Int32
	srv := testnet.Serve(ln, func(c net.Conn) { accepts.Add(1); c.Close() })
	t.Cleanup(srv.Close)
	w, rec := startWatcher(t, "http://"+srv.Addr(), Config{})
	waitFor(t, "five attempts", func() bool { return accepts.Load() >= 10 })
	if got := rec.warnings(); len(got) != 2 { // one per kind
		t.Errorf("warnings = %q, want one per kind", got)
	}
	if w.Synced() {
		t.Error("synced without an apiserver")
	}
}

// With Node set, the Watcher sees one Node and the Pods on it, and learns
// pod addresses outside the Node's pod CIDR from them.
func TestWatcherOneNode(t *testing.T) {
	testnet.CheckNoLeaks(t)
	f := newFakeAPI(t)
	f.put(pathNodes, nodeObj("a", []string{"192.168.0.1", "node-a"}, "10.244.0.0/24"))
	f.put(pathNodes, nodeObj("b", []string{"192.168.0.2"}, "10.244.1.0/24"))
	f.put(pathPods, podObj("default", "pa", "a", "172.31.1.1", "fd31::1"))
	f.put(pathPods, podObj("default", "pb", "b", "172.31.2.2"))
	w, _ := startWatcher(t, f.srv.URL, Config{Node: "a"})
	tb := w.Table()
	waitFor(t, "first list", w.Synced)
	checkLookups(t, tb, []lookupCase{
		{"192.168.0.1", "a", NodeAddress},
		{"node-a", "a", NodeAddress},
		{"10.244.0.5", "a", PodCIDR},
		{"172.31.1.1", "a", PodAddress},
		{"fd31::1", "a", PodAddress},
		{"192.168.0.2", "", NoMatch},
		{"10.244.1.5", "", NoMatch},
		{"172.31.2.2", "", NoMatch},
	})
	f.put(pathPods, podObj("default", "pa2", "a", "172.31.1.2"))
	waitFor(t, "new pod", routesTo(tb, "172.31.1.2", "a"))
	done := podObj("default", "pa2", "a", "172.31.1.2")
	done["status"].(map[string]any)["phase"] = "Succeeded"
	f.put(pathPods, done)
	waitFor(t, "finished pod dropped", routesTo(tb, "172.31.1.2", ""))
}

// With Pods, a server also learns pod addresses from Pods on every node,
// beside EndpointSlices; a Pod that leaves its address (finished, or on
// the host's network) places none.
func TestWatcherPods(t *testing.T) {
	testnet.CheckNoLeaks(t)
	f := newFakeAPI(t)
	f.put(pathNodes, nodeObj("a", []string{"192.168.0.1"}, "10.244.0.0/24"))
	f.put(pathNodes, nodeObj("b", []string{"192.168.0.2"}, "10.244.1.0/24"))
	f.put(pathPods, podObj("default", "pa", "a", "172.31.1.1"))
	hostNet := podObj("kube-system", "proxy-b", "b", "192.168.0.2")
	hostNet["spec"].(map[string]any)["hostNetwork"] = true
	f.put(pathPods, hostNet)
	w, _ := startWatcher(t, f.srv.URL, Config{Pods: true})
	tb := w.Table()
	waitFor(t, "first list", w.Synced)
	checkLookups(t, tb, []lookupCase{
		{"172.31.1.1", "a", PodAddress},
		{"192.168.0.2", "b", NodeAddress},
	})
	if _, pods := tb.Size(); pods != 1 {
		t.Errorf("pod addresses = %d, want 1 (the host-network pod places none)", pods)
	}
	f.put(pathPods, podObj("default", "pb", "b", "172.31.2.2"))
	waitFor(t, "new pod", routesTo(tb, "172.31.2.2", "b"))
	if n := f.count("LIST " + pathPods); n != 1 {
		t.Errorf("pod lists = %d, want 1", n)
	}
}
