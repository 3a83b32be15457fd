package e2e

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	coordinationclient "k8s.io/client-go/kubernetes/typed/coordination/v1"
	"k8s.io/client-go/rest"
)

const leaseToken = "lease-token"

// fakeLeaseAPI is an apiserver that serves coordination.k8s.io/v1 Leases
// as kube-apiserver does for get, create, update, delete (with
// resourceVersion preconditions), list and watch (with label selectors,
// parsed by apimachinery's own parser). Objects are apimachinery's Lease
// type, so what the binary writes must decode as the real type.
type fakeLeaseAPI struct {
	srv *httptest.Server

	mu      sync.Mutex
	rv      int64
	leases  map[string]*coordinationv1.Lease // by namespace/name
	events  []leaseEvent
	changed chan struct{}        // closed and replaced on every change
	deleted map[string]time.Time // when each Lease was last deleted
	created map[string]time.Time // when each Lease was last created
}

type leaseEvent struct {
	rv         int64
	typ        string
	lease      *coordinationv1.Lease
	prevLabels labels.Set
}

func startFakeLeaseAPI(t *testing.T) *fakeLeaseAPI {
	t.Helper()
	f := &fakeLeaseAPI{
		leases:  map[string]*coordinationv1.Lease{},
		changed: make(chan struct{}),
		deleted: map[string]time.Time{},
		created: map[string]time.Time{},
	}
	f.srv = httptest.NewTLSServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

// writeKubeconfig writes a kubeconfig for f with a static token.
func (f *fakeLeaseAPI) writeKubeconfig(t *testing.T, dir string) string {
	t.Helper()
	ca := filepath.Join(dir, "lease-api-ca.crt")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "lease-kubeconfig")
	writeKubeconfigFile(t, path, f.srv.URL, ca, fmt.Sprintf("{token: %q}", leaseToken))
	return path
}

// clientset is client-go talking to f: the real client reads what the
// servers wrote.
func (f *fakeLeaseAPI) clientset(t *testing.T) *coordinationclient.CoordinationV1Client {
	t.Helper()
	cfg := &rest.Config{
		Host:            f.srv.URL,
		BearerToken:     leaseToken,
		TLSClientConfig: rest.TLSClientConfig{CAData: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.srv.Certificate().Raw})},
	}
	cs, err := coordinationclient.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

func (f *fakeLeaseAPI) times(name string) (created, deleted time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.created[name], f.deleted[name]
}

func writeAPIStatus(w http.ResponseWriter, code int, reason metav1.StatusReason, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(&metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"},
		Status: metav1.StatusFailure, Message: msg, Reason: reason, Code: int32(code)})
}

func writeJSON(w http.ResponseWriter, code int, obj any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(obj)
}

func (f *fakeLeaseAPI) recordLocked(typ string, l *coordinationv1.Lease, prev labels.Set) {
	f.events = append(f.events, leaseEvent{rv: f.rv, typ: typ, lease: l.DeepCopy(), prevLabels: prev})
	close(f.changed)
	f.changed = make(chan struct{})
}

func (f *fakeLeaseAPI) serve(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Authorization") != "Bearer "+leaseToken {
		writeAPIStatus(w, http.StatusUnauthorized, metav1.StatusReasonUnauthorized, "Unauthorized")
		return
	}
	rest, ok := strings.CutPrefix(r.URL.Path, "/apis/coordination.k8s.io/v1/namespaces/")
	parts := strings.Split(rest, "/")
	if !ok || len(parts) < 2 || len(parts) > 3 || parts[1] != "leases" {
		writeAPIStatus(w, http.StatusNotFound, metav1.StatusReasonNotFound, "the server could not find the requested resource")
		return
	}
	ns, name := parts[0], ""
	if len(parts) == 3 {
		name = parts[2]
	}
	sel, err := labels.Parse(r.URL.Query().Get("labelSelector"))
	if err != nil {
		writeAPIStatus(w, http.StatusBadRequest, metav1.StatusReasonBadRequest, err.Error())
		return
	}
	switch {
	case r.Method == http.MethodGet && name == "" && r.URL.Query().Get("watch") == "true":
		f.watch(w, r, ns, sel)
	case r.Method == http.MethodGet && name == "":
		f.mu.Lock()
		list := coordinationv1.LeaseList{TypeMeta: metav1.TypeMeta{Kind: "LeaseList", APIVersion: "coordination.k8s.io/v1"}}
		list.ResourceVersion = strconv.FormatInt(f.rv, 10)
		for key, l := range f.leases {
			if strings.HasPrefix(key, ns+"/") && sel.Matches(labels.Set(l.Labels)) {
				list.Items = append(list.Items, *l.DeepCopy())
			}
		}
		f.mu.Unlock()
		writeJSON(w, http.StatusOK, &list)
	case r.Method == http.MethodGet:
		f.mu.Lock()
		l, ok := f.leases[ns+"/"+name]
		if ok {
			l = l.DeepCopy()
		}
		f.mu.Unlock()
		if !ok {
			writeAPIStatus(w, http.StatusNotFound, metav1.StatusReasonNotFound, fmt.Sprintf("leases.coordination.k8s.io %q not found", name))
			return
		}
		writeJSON(w, http.StatusOK, l)
	case r.Method == http.MethodPost || r.Method == http.MethodPut:
		f.write(w, r, ns, name)
	case r.Method == http.MethodDelete:
		f.delete(w, r, ns, name)
	default:
		writeAPIStatus(w, http.StatusMethodNotAllowed, metav1.StatusReasonMethodNotAllowed, "")
	}
}

func (f *fakeLeaseAPI) write(w http.ResponseWriter, r *http.Request, ns, name string) {
	var l coordinationv1.Lease
	dec := json.NewDecoder(io.LimitReader(r.Body, 1<<20))
	dec.DisallowUnknownFields() // a field the real type lacks is a bug in the writer
	if err := dec.Decode(&l); err != nil {
		writeAPIStatus(w, http.StatusBadRequest, metav1.StatusReasonBadRequest, err.Error())
		return
	}
	if l.Kind != "Lease" || l.APIVersion != "coordination.k8s.io/v1" || l.Name == "" || (name != "" && l.Name != name) || (l.Namespace != "" && l.Namespace != ns) {
		writeAPIStatus(w, http.StatusBadRequest, metav1.StatusReasonBadRequest, "not a Lease for this URL")
		return
	}
	l.Namespace = ns
	key := ns + "/" + l.Name
	f.mu.Lock()
	defer f.mu.Unlock()
	old, exists := f.leases[key]
	if r.Method == http.MethodPost {
		if exists {
			writeAPIStatus(w, http.StatusConflict, metav1.StatusReasonAlreadyExists, "already exists")
			return
		}
		f.rv++
		l.ResourceVersion = strconv.FormatInt(f.rv, 10)
		l.UID = types.UID("uid-" + l.ResourceVersion)
		l.CreationTimestamp = metav1.Now()
		f.leases[key] = &l
		f.created[l.Name] = time.Now()
		f.recordLocked("ADDED", &l, nil)
		writeJSON(w, http.StatusCreated, &l)
		return
	}
	if !exists {
		writeAPIStatus(w, http.StatusNotFound, metav1.StatusReasonNotFound, "not found")
		return
	}
	if l.ResourceVersion != old.ResourceVersion {
		writeAPIStatus(w, http.StatusConflict, metav1.StatusReasonConflict, "the object has been modified")
		return
	}
	f.rv++
	l.ResourceVersion = strconv.FormatInt(f.rv, 10)
	f.leases[key] = &l
	f.recordLocked("MODIFIED", &l, labels.Set(old.Labels))
	writeJSON(w, http.StatusOK, &l)
}

func (f *fakeLeaseAPI) delete(w http.ResponseWriter, r *http.Request, ns, name string) {
	var opts metav1.DeleteOptions
	if r.ContentLength != 0 {
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&opts); err != nil {
			writeAPIStatus(w, http.StatusBadRequest, metav1.StatusReasonBadRequest, err.Error())
			return
		}
	}
	key := ns + "/" + name
	f.mu.Lock()
	defer f.mu.Unlock()
	l, ok := f.leases[key]
	if !ok {
		writeAPIStatus(w, http.StatusNotFound, metav1.StatusReasonNotFound, "not found")
		return
	}
	if p := opts.Preconditions; p != nil && p.ResourceVersion != nil && *p.ResourceVersion != l.ResourceVersion {
		writeAPIStatus(w, http.StatusConflict, metav1.StatusReasonConflict, "Precondition failed")
		return
	}
	delete(f.leases, key)
	f.rv++
	f.deleted[name] = time.Now()
	f.recordLocked("DELETED", l, nil)
	writeJSON(w, http.StatusOK, &metav1.Status{Status: metav1.StatusSuccess})
}

func (f *fakeLeaseAPI) watch(w http.ResponseWriter, r *http.Request, ns string, sel labels.Selector) {
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
	for {
		f.mu.Lock()
		type out struct {
			Type   string                `json:"type"`
			Object *coordinationv1.Lease `json:"object"`
		}
		var evs []out
		for _, ev := range f.events {
			if ev.rv <= from || ev.lease.Namespace != ns {
				continue
			}
			typ := ev.typ
			now, before := sel.Matches(labels.Set(ev.lease.Labels)), typ == "MODIFIED" && sel.Matches(ev.prevLabels)
			switch {
			case now && typ == "MODIFIED" && !before:
				typ = "ADDED"
			case !now && before:
				typ = "DELETED"
			case !now:
				continue
			}
			evs = append(evs, out{typ, ev.lease})
		}
		from = f.rv
		changed := f.changed
		f.mu.Unlock()
		for _, ev := range evs {
			enc.Encode(ev)
		}
		if len(evs) > 0 {
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

// TestLeaseServerCount: three servers keep Leases, an agent that only
// knows a load balancer counts them. Scaling to two and back to three is
// followed by the agent within one sync interval of the Lease change; a
// server that re-executes itself keeps its Lease; a server that dies
// without deleting its Lease is culled by the others.
func TestLeaseServerCount(t *testing.T) {
	dir := t.TempDir()
	p := newPKI(t, dir)
	api := startFakeLeaseAPI(t)
	kubeconfig := api.writeKubeconfig(t, dir)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	const syncInterval = time.Second // upstream's default --sync-interval

	leaseFlags := []string{"--enable-lease-controller", "--kubeconfig=" + kubeconfig,
		"--lease-duration=3s", "--lease-renew-interval=500ms", "--lease-gc-interval=500ms"}
	var servers []*server
	var addrs []string
	for i := 1; i <= 3; i++ {
		// No --server-count: the count comes from the Leases.
		s := startServerOpts(t, serverOpts{pki: p, clusterCA: p.caCert,
			extra: append([]string{"--server-id=s" + strconv.Itoa(i)}, leaseFlags...)})
		servers = append(servers, s)
		addrs = append(addrs, "127.0.0.1:"+strconv.Itoa(s.agentPort))
	}
	lb := startProxy(t, addrs...)
	ag := startAgentArgs(t, "a1", append(mtlsAgentArgs(p, "127.0.0.1", lb.port()),
		"--sync-interval="+syncInterval.String(), "--sync-interval-cap=2s",
		"--count-server-leases", "--kubeconfig="+kubeconfig)...)
	el := waitMesh(t, servers, []*agent{ag}, 3, meshBound)
	t.Logf("agent counted 3 leases and holds 3/3 servers %v after start", el.Round(time.Millisecond))

	// What the servers wrote, read with client-go.
	cs := api.clientset(t)
	list, err := cs.Leases("kube-system").List(context.Background(), metav1.ListOptions{LabelSelector: "k8s-app=konnectivity-server"})
	if err != nil {
		t.Fatalf("client-go list: %v", err)
	}
	if len(list.Items) != 3 {
		t.Fatalf("%d leases, want 3", len(list.Items))
	}
	for _, l := range list.Items {
		id := strings.TrimPrefix(l.Name, "konnectivity-proxy-server-")
		if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != id || l.Spec.LeaseDurationSeconds == nil || *l.Spec.LeaseDurationSeconds != 3 ||
			l.Spec.RenewTime == nil || time.Since(l.Spec.RenewTime.Time) > 3*time.Second || l.Labels["k8s-app"] != "konnectivity-server" {
			t.Errorf("lease %s: %+v %+v", l.Name, l.Labels, l.Spec)
		}
	}

	knownCount := func() float64 {
		fams, _, err := scrapeRaw(ag.healthURL("/metrics"))
		if err != nil {
			return -1
		}
		return fams.value("konnectivity_network_proxy_agent_known_server_count")
	}
	// follow waits until the agent wants n servers and returns how long
	// after since that was.
	follow := func(n float64, since func() time.Time) time.Duration {
		t.Helper()
		waitFor(t, 10*time.Second, fmt.Sprintf("agent known_server_count = %v", n), func() bool { return knownCount() == n })
		return time.Since(since())
	}

	t.Run("scale-to-two", func(t *testing.T) {
		lb.setBackends(addrs[:2]...)
		servers[2].proc.signal(t, syscall.SIGTERM)
		<-servers[2].proc.done
		_, deleted := api.times("konnectivity-proxy-server-s3")
		if deleted.IsZero() {
			t.Fatalf("s3 exited without deleting its lease:\n%s", servers[2].proc.out.String())
		}
		lag := follow(2, func() time.Time { return deleted })
		t.Logf("agent wanted 2 servers %v after s3's lease was deleted", lag.Round(time.Millisecond))
		if lag > syncInterval {
			t.Errorf("agent followed the lease deletion after %v, more than one sync interval (%v)", lag, syncInterval)
		}
		waitReadyBody(t, ag.proc, ag.healthURL("/readyz?all&verbose"), http.StatusOK, "connected 2/2 servers", convergeBound)
	})

	t.Run("scale-to-three", func(t *testing.T) {
		servers[2].setArg("server-id", "s4")
		servers[2].launch(t)
		addrs[2] = "127.0.0.1:" + strconv.Itoa(servers[2].agentPort)
		lb.setBackends(addrs...)
		created, _ := api.times("konnectivity-proxy-server-s4")
		waitFor(t, 10*time.Second, "s4's lease", func() bool { created, _ = api.times("konnectivity-proxy-server-s4"); return !created.IsZero() })
		lag := follow(3, func() time.Time { return created })
		t.Logf("agent wanted 3 servers %v after s4's lease was created", lag.Round(time.Millisecond))
		if lag > syncInterval {
			t.Errorf("agent followed the new lease after %v, more than one sync interval (%v)", lag, syncInterval)
		}
		waitMesh(t, servers, []*agent{ag}, 3, convergeBound)
		checkReachable(t, servers[2].egressDialer(t), backend, "b1", 5)
	})

	t.Run("self-restart-keeps-lease", func(t *testing.T) {
		// With a fixed server ID the re-executed image renews the same
		// Lease: it is never deleted, so agents never count one less.
		s := servers[0]
		metricsURL := s.healthURL("/metrics")
		before := startTime(metricsURL)
		s.proc.signal(t, syscall.SIGHUP)
		waitNewImage(t, s.proc, metricsURL, before, 20*time.Second)
		restarted := time.Now()
		cs := api.clientset(t)
		waitFor(t, 10*time.Second, "s1's lease renewed by the new image", func() bool {
			l, err := cs.Leases("kube-system").Get(context.Background(), "konnectivity-proxy-server-s1", metav1.GetOptions{})
			return err == nil && l.Spec.RenewTime != nil && l.Spec.RenewTime.After(restarted)
		})
		if _, deleted := api.times("konnectivity-proxy-server-s1"); !deleted.IsZero() {
			t.Errorf("s1's lease was deleted during the self-restart")
		}
		if n := knownCount(); n != 3 {
			t.Errorf("agent wants %v servers after s1's restart, want 3", n)
		}
	})

	t.Run("crashed-server-culled", func(t *testing.T) {
		victim := servers[1]
		lb.setBackends(addrs[0], addrs[2])
		victim.proc.signal(t, syscall.SIGKILL)
		<-victim.proc.done
		// Its Lease runs out (3s) and the agent stops counting it then;
		// the other servers delete it.
		waitFor(t, 15*time.Second, "s2's lease to be culled", func() bool {
			_, deleted := api.times("konnectivity-proxy-server-s2")
			return !deleted.IsZero()
		})
		follow(2, time.Now)
		culled := 0.0
		for _, s := range []*server{servers[0], servers[2]} {
			fams := scrape(t, s.healthURL("/metrics"))
			if v := fams.value("konnectivity_network_proxy_server_culled_leases_count"); v > 0 {
				culled += v
			}
			if v := fams.value("konnectivity_network_proxy_server_lease_list_total", "http_status_code", "200", "reason", ""); v < 1 {
				t.Errorf("server lease_list_total{200} = %v", v)
			}
			if v := fams.value("konnectivity_network_proxy_server_lease_list_latency_seconds", "http_status_code", "200"); v < 1 {
				t.Errorf("server lease_list_latency_seconds{200} count = %v", v)
			}
		}
		if culled != 1 {
			t.Errorf("servers culled %v leases, want 1", culled)
		}
		fams := scrape(t, ag.healthURL("/metrics"))
		if v := fams.value("konnectivity_network_proxy_agent_lease_lists_total", "http_response_code", "200", "reason", ""); v < 1 {
			t.Errorf("agent lease_lists_total{200} = %v", v)
		}
		if v := fams.value("konnectivity_network_proxy_agent_lease_watches_total", "http_response_code", "200", "reason", ""); v < 1 {
			t.Errorf("agent lease_watches_total{200} = %v", v)
		}
	})
}

// TestLeaseCountWithoutAPI: an agent told to count Leases that has no
// kubeconfig and is not in a pod warns once and works with the count the
// server announces; a server with the lease controller and no apiserver
// says so and serves.
func TestLeaseCountWithoutAPI(t *testing.T) {
	noPod := []string{"KUBERNETES_SERVICE_HOST=", "KUBERNETES_SERVICE_PORT="}
	s := startServerBinEnv(t, "", noPod, frontendUDS, "--enable-lease-controller")
	a := &agent{id: "a1", healthPort: freePort(t), adminPort: freePort(t)}
	a.proc = startProcEnv(t, konnectivityBin, "agent-a1", noPod, "agent",
		"--proxy-server-host=127.0.0.1", "--proxy-server-port="+strconv.Itoa(s.agentPort),
		"--ca-cert="+s.pki.caCert, "--agent-cert="+s.pki.agentCert, "--agent-key="+s.pki.agentKey,
		"--agent-id=a1", "--health-server-host=127.0.0.1", "--health-server-port="+strconv.Itoa(a.healthPort),
		"--admin-server-port=0", "--count-server-leases", "--lease-label=k8s-app=konnectivity-server")
	waitReadyBody(t, a.proc, a.healthURL("/readyz?all&verbose"), http.StatusOK, "connected 1/1 servers", convergeBound)
	backend := startHTTPBackend(t, "127.0.0.1", "b1")
	checkReachable(t, s.egressDialer(t), backend, "b1", 3)
	out := a.proc.out.String()
	if n := strings.Count(out, "cannot count server leases"); n != 1 {
		t.Errorf("agent warned %d times, want once:\n%s", n, out)
	}
	if !strings.Contains(out, "--lease-label is deprecated") {
		t.Errorf("no deprecation warning for --lease-label:\n%s", out)
	}
	// Upstream exports the unlabelled lease counter whether or not the
	// controller runs; so does this server.
	if v := metricValue(t, s.healthURL("/metrics"), "konnectivity_network_proxy_server_culled_leases_count"); v != 0 {
		t.Errorf("culled_leases_count = %v, want 0", v)
	}
	if n := strings.Count(s.proc.out.String(), "lease controller off"); n != 1 {
		t.Errorf("server said %d times that it keeps no lease, want once:\n%s", n, s.proc.out.String())
	}
}
