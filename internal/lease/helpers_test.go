package lease

import (
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/internal/kubeclient"
)

// fakeAPI is an apiserver that speaks the coordination.k8s.io/v1 Lease API
// the way kube-apiserver does for the calls this package makes: get,
// create, update and delete with resourceVersion preconditions, list and
// watch with a label selector, Status objects for errors, 410 for a watch
// from a compacted resourceVersion. It checks a bearer token.
type fakeAPI struct {
	srv *httptest.Server

	mu        sync.Mutex
	rv        int64                     // last resourceVersion handed out
	objects   map[string]map[string]any // by namespace/name
	events    []fakeEvent               // every change, in order
	compacted int64                     // watches from below this get 410
	changed   chan struct{}             // closed and replaced on every change
	token     string                    // accepted bearer token
	seen      map[string]int            // requests by "VERB kind"
	tokens    map[string]int            // bearer tokens seen
	fail      func(r *http.Request) (code int, reason string)
}

type fakeEvent struct {
	rv     int64
	typ    string
	ns     string
	labels map[string]string
	prev   map[string]string // labels before a MODIFIED
	obj    []byte
}

func newFakeAPI(t *testing.T, token string) *fakeAPI {
	t.Helper()
	f := &fakeAPI{
		objects: map[string]map[string]any{},
		changed: make(chan struct{}),
		token:   token,
		seen:    map[string]int{},
		tokens:  map[string]int{},
	}
	f.srv = httptest.NewTLSServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

// kubeconfig writes a kubeconfig for f that reads its token from tokenFile
// and returns the loaded config.
func (f *fakeAPI) restConfig(t *testing.T, tokenFile string) *kubeclient.Config {
	t.Helper()
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster: {server: %q, certificate-authority: %q}
users:
- name: u
  user: {tokenFile: %q}
contexts:
- name: fake
  context: {cluster: fake, user: u}
current-context: fake
`, f.srv.URL, ca, tokenFile)
	path := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(path, []byte(kc), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := kubeclient.LoadKubeconfig(path, "")
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func (f *fakeAPI) requests(key string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.seen[key]
}

func (f *fakeAPI) setFail(fn func(r *http.Request) (int, string)) {
	f.mu.Lock()
	f.fail = fn
	f.mu.Unlock()
}

// failWatches makes the fake answer every watch with code and reason, and
// every other request as usual.
func (f *fakeAPI) failWatches(code int, reason string) {
	f.setFail(func(r *http.Request) (int, string) {
		if r.URL.Query().Get("watch") == "true" {
			return code, reason
		}
		return 0, ""
	})
}

// put stores obj as if a client created or updated it, returning the new
// resourceVersion.
func (f *fakeAPI) put(ns string, obj map[string]any) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	meta := obj["metadata"].(map[string]any)
	meta["namespace"] = ns
	key := ns + "/" + meta["name"].(string)
	typ := "ADDED"
	if _, ok := f.objects[key]; ok {
		typ = "MODIFIED"
	}
	return f.storeLocked(key, ns, obj, typ)
}

// remove deletes a Lease behind everybody's back.
func (f *fakeAPI) remove(ns, name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if obj, ok := f.objects[ns+"/"+name]; ok {
		delete(f.objects, ns+"/"+name)
		f.rv++
		f.recordLocked("DELETED", ns, obj)
	}
}

func (f *fakeAPI) get(ns, name string) (*Lease, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	obj, ok := f.objects[ns+"/"+name]
	if !ok {
		return nil, false
	}
	data, _ := json.Marshal(obj)
	l, err := decodeLease(data)
	if err != nil {
		panic(err)
	}
	return l, true
}

// compact makes watches from any resourceVersion seen so far fail with 410.
func (f *fakeAPI) compact() {
	f.mu.Lock()
	f.compacted = f.rv + 1
	f.events = nil
	f.mu.Unlock()
}

func (f *fakeAPI) storeLocked(key, ns string, obj map[string]any, typ string) string {
	var prev map[string]string
	if old, ok := f.objects[key]; ok {
		prev = labelsOf(old)
	}
	f.rv++
	meta := obj["metadata"].(map[string]any)
	meta["resourceVersion"] = strconv.FormatInt(f.rv, 10)
	obj["apiVersion"], obj["kind"] = "coordination.k8s.io/v1", "Lease"
	f.objects[key] = obj
	f.recordLocked(typ, ns, obj)
	f.events[len(f.events)-1].prev = prev
	return meta["resourceVersion"].(string)
}

func (f *fakeAPI) recordLocked(typ, ns string, obj map[string]any) {
	data, _ := json.Marshal(obj)
	f.events = append(f.events, fakeEvent{rv: f.rv, typ: typ, ns: ns, labels: labelsOf(obj), obj: data})
	close(f.changed)
	f.changed = make(chan struct{})
}

func labelsOf(obj map[string]any) map[string]string {
	out := map[string]string{}
	meta, _ := obj["metadata"].(map[string]any)
	ls, _ := meta["labels"].(map[string]any)
	for k, v := range ls {
		out[k], _ = v.(string)
	}
	return out
}

func writeStatus(w http.ResponseWriter, code int, reason, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]any{"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": msg, "reason": reason, "code": code})
}

func writeObject(w http.ResponseWriter, code int, obj any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(obj)
}

func (f *fakeAPI) serve(w http.ResponseWriter, r *http.Request) {
	tok := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	f.mu.Lock()
	f.tokens[tok]++
	fail := f.fail
	f.mu.Unlock()
	if tok != f.token {
		writeStatus(w, http.StatusUnauthorized, "Unauthorized", "Unauthorized")
		return
	}
	rest, ok := strings.CutPrefix(r.URL.Path, "/apis/coordination.k8s.io/v1/namespaces/")
	parts := strings.Split(rest, "/")
	if !ok || len(parts) < 2 || len(parts) > 3 || parts[1] != "leases" {
		writeStatus(w, http.StatusNotFound, "NotFound", "the server could not find the requested resource")
		return
	}
	ns, name := parts[0], ""
	if len(parts) == 3 {
		name = parts[2]
	}
	verb := r.Method
	switch {
	case r.Method == http.MethodGet && name == "" && r.URL.Query().Get("watch") == "true":
		verb = "WATCH"
	case r.Method == http.MethodGet && name == "":
		verb = "LIST"
	}
	f.mu.Lock()
	f.seen[verb]++
	f.mu.Unlock()
	if fail != nil {
		if code, reason := fail(r); code != 0 {
			writeStatus(w, code, reason, "injected")
			return
		}
	}
	switch verb {
	case "LIST":
		f.list(w, r, ns)
	case "WATCH":
		f.watch(w, r, ns)
	case http.MethodGet:
		f.mu.Lock()
		obj, ok := f.objects[ns+"/"+name]
		data, _ := json.Marshal(obj)
		f.mu.Unlock()
		if !ok {
			writeStatus(w, http.StatusNotFound, "NotFound", fmt.Sprintf("leases.coordination.k8s.io %q not found", name))
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write(data)
	case http.MethodPost, http.MethodPut:
		f.write(w, r, ns, name)
	case http.MethodDelete:
		f.delete(w, r, ns, name)
	default:
		writeStatus(w, http.StatusMethodNotAllowed, "MethodNotAllowed", "")
	}
}

func (f *fakeAPI) selector(w http.ResponseWriter, r *http.Request) (Selector, bool) {
	sel, err := ParseSelector(r.URL.Query().Get("labelSelector"))
	if err != nil {
		writeStatus(w, http.StatusBadRequest, "BadRequest", err.Error())
		return Selector{}, false
	}
	return sel, true
}

func (f *fakeAPI) list(w http.ResponseWriter, r *http.Request, ns string) {
	sel, ok := f.selector(w, r)
	if !ok {
		return
	}
	f.mu.Lock()
	items := []any{}
	for key, obj := range f.objects {
		if strings.HasPrefix(key, ns+"/") && sel.Matches(labelsOf(obj)) {
			items = append(items, obj)
		}
	}
	rv := strconv.FormatInt(f.rv, 10)
	f.mu.Unlock()
	writeObject(w, http.StatusOK, map[string]any{
		"apiVersion": "coordination.k8s.io/v1", "kind": "LeaseList",
		"metadata": map[string]any{"resourceVersion": rv}, "items": items,
	})
}

func (f *fakeAPI) watch(w http.ResponseWriter, r *http.Request, ns string) {
	sel, ok := f.selector(w, r)
	if !ok {
		return
	}
	from, _ := strconv.ParseInt(r.URL.Query().Get("resourceVersion"), 10, 64)
	secs, _ := strconv.Atoi(r.URL.Query().Get("timeoutSeconds"))
	if secs <= 0 {
		secs = 60
	}
	end := time.NewTimer(time.Duration(secs) * time.Second)
	defer end.Stop()
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	fl := w.(http.Flusher)
	fl.Flush()
	enc := json.NewEncoder(w)
	f.mu.Lock()
	if from != 0 && from < f.compacted {
		f.mu.Unlock()
		enc.Encode(map[string]any{"type": "ERROR", "object": map[string]any{"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "too old resource version", "reason": "Expired", "code": 410}})
		fl.Flush()
		return
	}
	if from == 0 {
		from = f.rv
	}
	f.mu.Unlock()
	for {
		f.mu.Lock()
		var out []fakeEvent
		for _, ev := range f.events {
			if ev.rv <= from || ev.ns != ns {
				continue
			}
			// As kube-apiserver: an object that starts or stops matching
			// the selector is ADDED or DELETED for this watch.
			now, before := sel.Matches(ev.labels), ev.typ == "MODIFIED" && sel.Matches(ev.prev)
			switch {
			case now && ev.typ == "MODIFIED" && !before:
				ev.typ = "ADDED"
			case !now && before:
				ev.typ = "DELETED"
			case !now:
				continue
			}
			out = append(out, ev)
		}
		from = f.rv
		changed := f.changed
		f.mu.Unlock()
		for _, ev := range out {
			enc.Encode(map[string]any{"type": ev.typ, "object": json.RawMessage(ev.obj)})
		}
		if len(out) > 0 {
			fl.Flush()
		}
		select {
		case <-changed:
		case <-end.C:
			return
		case <-r.Context().Done():
			return
		}
	}
}

func (f *fakeAPI) write(w http.ResponseWriter, r *http.Request, ns, name string) {
	var obj map[string]any
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&obj); err != nil {
		writeStatus(w, http.StatusBadRequest, "BadRequest", err.Error())
		return
	}
	if obj["kind"] != "Lease" || obj["apiVersion"] != "coordination.k8s.io/v1" {
		writeStatus(w, http.StatusBadRequest, "BadRequest", "not a coordination.k8s.io/v1 Lease")
		return
	}
	meta, _ := obj["metadata"].(map[string]any)
	if meta == nil || meta["name"] == nil {
		writeStatus(w, http.StatusUnprocessableEntity, "Invalid", "metadata.name: Required value")
		return
	}
	objName, _ := meta["name"].(string)
	if name != "" && objName != name {
		writeStatus(w, http.StatusBadRequest, "BadRequest", "the name of the object does not match the name on the URL")
		return
	}
	if err := validName(objName, 253); err != nil {
		writeStatus(w, http.StatusUnprocessableEntity, "Invalid", "metadata.name: "+err.Error())
		return
	}
	if ms, _ := meta["namespace"].(string); ms != "" && ms != ns {
		writeStatus(w, http.StatusBadRequest, "BadRequest", "the namespace of the object does not match the namespace on the URL")
		return
	}
	meta["namespace"] = ns
	key := ns + "/" + objName
	f.mu.Lock()
	defer f.mu.Unlock()
	old, exists := f.objects[key]
	if r.Method == http.MethodPost {
		if exists {
			writeStatus(w, http.StatusConflict, "AlreadyExists", fmt.Sprintf("leases.coordination.k8s.io %q already exists", objName))
			return
		}
		meta["uid"] = fmt.Sprintf("uid-%d", f.rv+1)
		meta["creationTimestamp"] = time.Now().UTC().Format(time.RFC3339)
		f.storeLocked(key, ns, obj, "ADDED")
		writeObject(w, http.StatusCreated, obj)
		return
	}
	if !exists {
		writeStatus(w, http.StatusNotFound, "NotFound", fmt.Sprintf("leases.coordination.k8s.io %q not found", objName))
		return
	}
	oldRV := old["metadata"].(map[string]any)["resourceVersion"]
	if rv, _ := meta["resourceVersion"].(string); rv == "" || rv != oldRV {
		writeStatus(w, http.StatusConflict, "Conflict", "the object has been modified; please apply your changes to the latest version and try again")
		return
	}
	f.storeLocked(key, ns, obj, "MODIFIED")
	writeObject(w, http.StatusOK, obj)
}

func (f *fakeAPI) delete(w http.ResponseWriter, r *http.Request, ns, name string) {
	var opts struct {
		Preconditions struct {
			ResourceVersion *string `json:"resourceVersion"`
		} `json:"preconditions"`
	}
	if r.ContentLength != 0 {
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&opts); err != nil {
			writeStatus(w, http.StatusBadRequest, "BadRequest", err.Error())
			return
		}
	}
	key := ns + "/" + name
	f.mu.Lock()
	defer f.mu.Unlock()
	obj, ok := f.objects[key]
	if !ok {
		writeStatus(w, http.StatusNotFound, "NotFound", fmt.Sprintf("leases.coordination.k8s.io %q not found", name))
		return
	}
	if p := opts.Preconditions.ResourceVersion; p != nil && *p != obj["metadata"].(map[string]any)["resourceVersion"] {
		writeStatus(w, http.StatusConflict, "Conflict", "Precondition failed: ResourceVersion")
		return
	}
	delete(f.objects, key)
	f.rv++
	f.recordLocked("DELETED", ns, obj)
	writeObject(w, http.StatusOK, map[string]any{"kind": "Status", "apiVersion": "v1", "status": "Success"})
}

// leaseObject is a Lease as a client would create it.
func leaseObject(name, holder string, labels map[string]string, renew time.Time, secs int) map[string]any {
	ls := map[string]any{}
	for k, v := range labels {
		ls[k] = v
	}
	return map[string]any{
		"metadata": map[string]any{"name": name, "labels": ls},
		"spec": map[string]any{
			"holderIdentity":       holder,
			"leaseDurationSeconds": secs,
			"renewTime":            formatTime(renew),
		},
	}
}

// checkNoLeaks fails the test if goroutines started during it still run
// once its cleanups (the fake's Close among them) are done.
func checkNoLeaks(t *testing.T) {
	t.Helper()
	base := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for runtime.NumGoroutine() > base {
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Errorf("goroutines: %d at start, %d after cleanup\n%s", base, runtime.NumGoroutine(), buf)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}
