package nodemap

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeapi"
	"github.com/spinifex/konnectivity/internal/kubeclient"
)

// fakeAPI serves Nodes, EndpointSlices and Pods the way kube-apiserver
// does for the calls a Watcher makes: paged lists with a resourceVersion,
// watches from a resourceVersion (410 when it is compacted away), field
// selectors on metadata.name and spec.nodeName, and Status errors.
type fakeAPI struct {
	srv *httptest.Server

	mu        sync.Mutex
	rv        int64
	objects   map[string]map[string]any // by "path key"
	events    []fakeEvent
	compacted int64         // watches from below this get 410
	changed   chan struct{} // closed and replaced on every change
	seen      map[string]int
	fail      func(r *http.Request) int // a status code to answer with, or 0
}

type fakeEvent struct {
	rv   int64
	path string
	typ  string
	obj  map[string]any
}

const (
	pathNodes  = "/api/v1/nodes"
	pathSlices = "/apis/discovery.k8s.io/v1/endpointslices"
	pathPods   = "/api/v1/pods"
)

func newFakeAPI(t *testing.T) *fakeAPI {
	t.Helper()
	f := &fakeAPI{objects: map[string]map[string]any{}, changed: make(chan struct{}), seen: map[string]int{}}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func restConfigFor(t *testing.T, server string) *kubeclient.Config {
	t.Helper()
	kc := fmt.Sprintf("apiVersion: v1\nkind: Config\nclusters:\n- name: f\n  cluster: {server: %q}\nusers:\n- name: u\n  user: {token: secret-token}\ncontexts:\n- name: f\n  context: {cluster: f, user: u}\ncurrent-context: f\n", server)
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := kubeclient.LoadKubeconfig(path, "")
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func objKey(obj map[string]any) string {
	m := obj["metadata"].(map[string]any)
	if ns, _ := m["namespace"].(string); ns != "" {
		return ns + "/" + m["name"].(string)
	}
	return m["name"].(string)
}

// put stores obj (ADDED or MODIFIED) under path.
func (f *fakeAPI) put(path string, obj map[string]any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := path + " " + objKey(obj)
	typ := "ADDED"
	if _, ok := f.objects[k]; ok {
		typ = "MODIFIED"
	}
	f.rv++
	obj["metadata"].(map[string]any)["resourceVersion"] = strconv.FormatInt(f.rv, 10)
	f.objects[k] = obj
	f.events = append(f.events, fakeEvent{rv: f.rv, path: path, typ: typ, obj: obj})
	close(f.changed)
	f.changed = make(chan struct{})
}

func (f *fakeAPI) del(path, key string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	obj, ok := f.objects[path+" "+key]
	if !ok {
		return
	}
	delete(f.objects, path+" "+key)
	f.rv++
	f.events = append(f.events, fakeEvent{rv: f.rv, path: path, typ: "DELETED", obj: obj})
	close(f.changed)
	f.changed = make(chan struct{})
}

// compact makes every watch from before now answer 410 and ends the open
// ones, as an etcd compaction does.
func (f *fakeAPI) compact() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.compacted = f.rv + 1
	f.rv++
	close(f.changed)
	f.changed = make(chan struct{})
}

func (f *fakeAPI) setFail(fn func(r *http.Request) int) {
	f.mu.Lock()
	f.fail = fn
	f.mu.Unlock()
}

func (f *fakeAPI) count(key string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.seen[key]
}

func matches(obj map[string]any, selector string) bool {
	if selector == "" {
		return true
	}
	field, want, _ := strings.Cut(selector, "=")
	switch field {
	case "metadata.name":
		return obj["metadata"].(map[string]any)["name"] == want
	case "spec.nodeName":
		spec, _ := obj["spec"].(map[string]any)
		return spec["nodeName"] == want
	}
	return false
}

func writeStatus(w http.ResponseWriter, code int, reason string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]any{"kind": "Status", "code": code, "reason": reason, "message": "fake: " + reason})
}

func (f *fakeAPI) serve(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	verb := "LIST"
	if q.Get("watch") == "true" {
		verb = "WATCH"
	}
	f.mu.Lock()
	f.seen[verb+" "+r.URL.Path]++
	fail := f.fail
	f.mu.Unlock()
	if r.Header.Get("Authorization") != "Bearer secret-token" {
		writeStatus(w, 401, "Unauthorized")
		return
	}
	if fail != nil {
		if code := fail(r); code != 0 {
			writeStatus(w, code, http.StatusText(code))
			return
		}
	}
	switch r.URL.Path {
	case pathNodes, pathSlices, pathPods:
	default:
		writeStatus(w, 404, "NotFound")
		return
	}
	if verb == "WATCH" {
		f.serveWatch(w, r)
		return
	}
	f.serveList(w, r)
}

func (f *fakeAPI) serveList(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f.mu.Lock()
	var keys []string
	for k, obj := range f.objects {
		if strings.HasPrefix(k, r.URL.Path+" ") && matches(obj, q.Get("fieldSelector")) {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	start, _ := strconv.Atoi(q.Get("continue"))
	limit, _ := strconv.Atoi(q.Get("limit"))
	if limit <= 0 {
		limit = len(keys)
	}
	end := min(start+limit, len(keys))
	items := []any{}
	for _, k := range keys[min(start, len(keys)):end] {
		items = append(items, f.objects[k])
	}
	cont := ""
	if end < len(keys) {
		cont = strconv.Itoa(end)
	}
	body, _ := json.Marshal(map[string]any{
		"kind":       "List",
		"apiVersion": "v1",
		"metadata":   map[string]any{"resourceVersion": strconv.FormatInt(f.rv, 10), "continue": cont},
		"items":      items,
	})
	f.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.Write(body)
}

func (f *fakeAPI) serveWatch(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	from, _ := strconv.ParseInt(q.Get("resourceVersion"), 10, 64)
	secs, _ := strconv.Atoi(q.Get("timeoutSeconds"))
	f.mu.Lock()
	compacted := from < f.compacted
	f.mu.Unlock()
	if compacted {
		writeStatus(w, 410, "Expired")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(200)
	w.(http.Flusher).Flush()
	timeout := time.NewTimer(time.Duration(secs) * time.Second)
	defer timeout.Stop()
	for {
		f.mu.Lock()
		if from < f.compacted {
			f.mu.Unlock()
			return // the watch ends; the next one from here gets 410
		}
		var buf bytes.Buffer
		for _, ev := range f.events {
			if ev.rv > from && ev.path == r.URL.Path && matches(ev.obj, q.Get("fieldSelector")) {
				json.NewEncoder(&buf).Encode(map[string]any{"type": ev.typ, "object": ev.obj})
			}
		}
		if f.rv > from {
			from = f.rv
		}
		changed := f.changed
		f.mu.Unlock()
		if buf.Len() > 0 {
			if _, err := w.Write(buf.Bytes()); err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
		select {
		case <-changed:
		case <-timeout.C:
			return
		case <-r.Context().Done():
			return
		}
	}
}

func nodeObj(name string, addrs []string, cidrs ...string) map[string]any {
	var as []any
	for _, a := range addrs {
		typ := "InternalIP"
		if !strings.ContainsAny(a, ".:") || strings.Contains(a, "-") {
			typ = "Hostname"
		}
		as = append(as, map[string]any{"type": typ, "address": a})
	}
	spec := map[string]any{}
	if len(cidrs) > 0 {
		spec["podCIDR"] = cidrs[0]
		spec["podCIDRs"] = cidrs
	}
	return map[string]any{
		"kind":     "Node",
		"metadata": map[string]any{"name": name, "labels": map[string]any{"kubernetes.io/hostname": name}},
		"spec":     spec,
		"status":   map[string]any{"addresses": as, "images": []any{map[string]any{"names": []any{"registry/x:1"}, "sizeBytes": 1}}},
	}
}

// sliceObj is an EndpointSlice with one endpoint per address, each on the
// node after it: sliceObj("ns", "s", "10.0.0.1", "node-a", "10.0.0.2", "node-b").
func sliceObj(ns, name string, addrNode ...string) map[string]any {
	var eps []any
	for i := 0; i+1 < len(addrNode); i += 2 {
		eps = append(eps, map[string]any{
			"addresses":  []any{addrNode[i]},
			"nodeName":   addrNode[i+1],
			"conditions": map[string]any{"ready": true},
		})
	}
	return map[string]any{
		"kind":        "EndpointSlice",
		"metadata":    map[string]any{"name": name, "namespace": ns},
		"addressType": "IPv4",
		"endpoints":   eps,
		"ports":       []any{map[string]any{"port": 443}},
	}
}

func podObj(ns, name, nodeName string, ips ...string) map[string]any {
	var podIPs []any
	for _, ip := range ips {
		podIPs = append(podIPs, map[string]any{"ip": ip})
	}
	return map[string]any{
		"kind":     "Pod",
		"metadata": map[string]any{"name": name, "namespace": ns},
		"spec":     map[string]any{"nodeName": nodeName},
		"status":   map[string]any{"phase": "Running", "podIPs": podIPs},
	}
}

// logRecorder is a slog handler that keeps the messages logged at Warn and
// above.
type logRecorder struct {
	mu    sync.Mutex
	warns []string
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }

func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		l.mu.Lock()
		l.warns = append(l.warns, r.Message)
		l.mu.Unlock()
	}
	return nil
}

func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecorder) WithGroup(string) slog.Handler      { return l }

func (l *logRecorder) warnings() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.warns...)
}

func (m Match) String() string {
	switch m {
	case NodeAddress:
		return "node_address"
	case PodAddress:
		return "pod_address"
	case PodCIDR:
		return "pod_cidr"
	}
	return "none"
}

// Node returns a copy of the named Node.
func (t *Table) Node(name string) (kubeapi.Node, bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	n, ok := t.nodes[name]
	if !ok {
		return kubeapi.Node{}, false
	}
	return kubeapi.Node{
		Name:      n.Name,
		Addresses: slices.Clone(n.Addresses),
		Hostnames: slices.Clone(n.Hostnames),
		PodCIDRs:  slices.Clone(n.PodCIDRs),
	}, true
}
