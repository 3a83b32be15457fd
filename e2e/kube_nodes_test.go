package e2e

// Routing by node under a real kube-apiserver: two Nodes, each with its
// own network namespace that holds only that node's kubelet and pod
// addresses, and its own agent (a pod-bound token for that node) inside
// it. Run by TestKubeAPIServer (as the subtest node-routing) inside its
// private namespaces.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// kubeNodeSpec is one node of the routing test and what lives in its
// network namespace.
type kubeNodeSpec struct {
	name, netns   string
	kubeletIP     string
	podCIDR       string
	podName       string
	podIP         string
	kubelet       *kubeletStandIn
	kubeletSrv    *kubeBackend
	podSrv        *kubeBackend
	agent         *agent
	agentToken    string     // for the konnectivity server
	apiKubeconfig string     // the agent's own credential for the apiserver
	serverFwd     *forwarder // in the namespace, to the server's agent port
	apiFwd        *forwarder // in the namespace, to kube-apiserver
}

const (
	nodeWebhookIP = "172.31.0.20" // the webhook's pod, on node B, outside every pod CIDR
	nodeRounds    = 6             // calls of each kind per phase
)

func kubeNodeRouting(t *testing.T, apiserverBin, etcdBin string) {
	start := time.Now()
	nodes := []*kubeNodeSpec{
		{name: "node-a", netns: "kn-a", kubeletIP: "192.0.2.11", podCIDR: "10.244.0.0/24", podName: "pa", podIP: "10.244.0.5", kubelet: &kubeletStandIn{}},
		{name: "node-b", netns: "kn-b", kubeletIP: "192.0.2.12", podCIDR: "10.244.1.0/24", podName: "pb", podIP: "10.244.1.5", kubelet: &kubeletStandIn{}},
	}
	a, b := nodes[0], nodes[1]
	for _, n := range nodes {
		addrs := []string{n.kubeletIP, n.podIP}
		if n == b {
			addrs = append(addrs, nodeWebhookIP)
		}
		makeNetns(t, n.netns, addrs...)
	}
	dir, err := os.MkdirTemp("", "kne2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "konnectivity-server.socket")
	c := startKubeCluster(t, apiserverBin, etcdBin, egressConfigFor(t, dir, sock, "http-connect"), net.ParseIP(kubeNodeIP))
	e := &kubeEnv{mode: "node", c: c}

	// --- RBAC: the server reviews tokens and follows Nodes and
	// EndpointSlices; the agents read their own Node and Pods.
	c.create(t, "/api/v1/namespaces", obj("Namespace", "v1", kubeNS, ""))
	c.create(t, "/api/v1/namespaces/kube-system/serviceaccounts", obj("ServiceAccount", "v1", "konnectivity-agent", "kube-system"))
	c.create(t, "/api/v1/namespaces/"+kubeNS+"/serviceaccounts", obj("ServiceAccount", "v1", "default", kubeNS))
	srvCert, srvKey, _ := c.pki.issue(t, "konnectivity-server-client", true, "system:konnectivity-server", nil, nil, nil)
	user := map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:konnectivity-server"}
	agentSA := map[string]any{"kind": "ServiceAccount", "name": "konnectivity-agent", "namespace": "kube-system"}
	bind(t, c, "konnectivity-server-auth-delegator", "system:auth-delegator", user)
	role(t, c, "konnectivity-server-node-routes", []any{
		map[string]any{"apiGroups": []string{""}, "resources": []string{"nodes"}, "verbs": []string{"get", "list", "watch"}},
		map[string]any{"apiGroups": []string{"discovery.k8s.io"}, "resources": []string{"endpointslices"}, "verbs": []string{"list", "watch"}},
	})
	bind(t, c, "konnectivity-server-node-routes", "konnectivity-server-node-routes", user)
	role(t, c, "konnectivity-agent-own-node", []any{
		map[string]any{"apiGroups": []string{""}, "resources": []string{"nodes", "pods"}, "verbs": []string{"list", "watch"}},
	})
	bind(t, c, "konnectivity-agent-own-node", "konnectivity-agent-own-node", agentSA)

	// --- Each node: its kubelet stand-in and a pod server inside its
	// namespace, the Node, the agent's Pod and a workload Pod.
	for _, n := range nodes {
		inNetns(t, n.netns, func() {
			n.kubeletSrv = startKubeBackend(t, n.kubeletIP, c.pki.serving(t, "kubelet-"+n.name, nil, []net.IP{net.ParseIP(n.kubeletIP)}), n.kubelet)
			n.podSrv = startKubeBackend(t, n.podIP, c.pki.serving(t, "pod-"+n.podName, nil, []net.IP{net.ParseIP(n.podIP)}), podHandler(n.podName))
		})
		node := obj("Node", "v1", n.name, "")
		node["spec"] = map[string]any{"podCIDR": n.podCIDR, "podCIDRs": []string{n.podCIDR}}
		c.create(t, "/api/v1/nodes", node)
		patchStatus(t, c, "/api/v1/nodes/"+n.name+"/status", map[string]any{
			"addresses":       []any{map[string]any{"type": "InternalIP", "address": n.kubeletIP}},
			"daemonEndpoints": map[string]any{"kubeletEndpoint": map[string]any{"Port": n.kubeletSrv.port}},
			"conditions":      []any{map[string]any{"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": time.Now().UTC().Format(time.RFC3339)}},
		})
		agentPod := "konnectivity-agent-" + n.name
		c.create(t, "/api/v1/namespaces/kube-system/pods", podOn(agentPod, "kube-system", "konnectivity-agent", n.name))
		c.create(t, "/api/v1/namespaces/"+kubeNS+"/pods", podOn(n.podName, kubeNS, "default", n.name))
		patchStatus(t, c, "/api/v1/namespaces/"+kubeNS+"/pods/"+n.podName+"/status", map[string]any{
			"phase": "Running", "podIP": n.podIP, "podIPs": []any{map[string]any{"ip": n.podIP}},
		})
		n.agentToken = writeToken(t, c, dir, agentPod, agentAudience)
		apiToken := writeToken(t, c, dir, agentPod, "")
		inNetns(t, n.netns, func() {
			n.serverFwd = forwardFromNetns(t, "") // its target is set once the server's port is known
			n.apiFwd = forwardFromNetns(t, strings.TrimPrefix(c.url, "https://"))
		})
		n.apiKubeconfig = filepath.Join(dir, n.name+"-kubeconfig")
		writeKubeconfigFile(t, n.apiKubeconfig, "https://127.0.0.1:"+strconv.Itoa(n.apiFwd.port), c.pki.caFile, fmt.Sprintf("{token: %q}", apiToken))
	}

	// --- The webhook: a Service whose one endpoint is a pod on node B,
	// at an address outside node B's pod CIDR (learned from the slice).
	var reviews atomic.Int64
	var whSrv *kubeBackend
	inNetns(t, b.netns, func() {
		whSrv = startKubeBackend(t, nodeWebhookIP, c.pki.serving(t, "webhook", []string{"webhook." + kubeNS + ".svc"}, nil), webhookHandler(&reviews))
	})
	serviceOnNode(t, c, "webhook", nodeWebhookIP, b.name, whSrv.port)
	createConfigMapWebhook(t, c, "konnectivity-e2e-nodes")

	// --- The server, node first.
	kubeconfig := filepath.Join(dir, "kubeconfig")
	c.writeKubeconfig(t, kubeconfig, srvCert, srvKey)
	p := newPKI(t, dir)
	s := &server{owner: t, dir: dir, pki: p, sock: sock, agentPort: freePort(t), healthPort: freePort(t), adminPort: freePort(t)}
	serverArgs := func(strategies string) []string {
		return []string{"server", "--mode=http-connect",
			"--uds-name=" + sock, "--server-port=0",
			"--agent-bind-address=127.0.0.1", "--agent-port=" + strconv.Itoa(s.agentPort),
			"--cluster-cert=" + p.serverCert, "--cluster-key=" + p.serverKey,
			"--kubeconfig=" + kubeconfig,
			"--authentication-audience=" + agentAudience,
			"--agent-namespace=kube-system", "--agent-service-account=konnectivity-agent",
			"--proxy-strategies=" + strategies,
			"--health-bind-address=127.0.0.1", "--health-port=" + strconv.Itoa(s.healthPort),
			"--admin-bind-address=127.0.0.1", "--admin-port=" + strconv.Itoa(s.adminPort),
			"--agent-wait=2s", "--graceful-shutdown-timeout=2s",
		}
	}
	s.args = serverArgs("node,default")
	s.launch(t)
	for _, n := range nodes {
		n.serverFwd.target.Store("127.0.0.1:" + strconv.Itoa(s.agentPort))
	}
	startNodeAgent := func(n *kubeNodeSpec, extra ...string) {
		tokenFile := filepath.Join(dir, n.name+"-agent-token")
		if err := os.WriteFile(tokenFile, []byte(n.agentToken), 0o600); err != nil {
			t.Fatal(err)
		}
		args := append([]string{"netns", "exec", n.netns, konnectivityBin, "agent",
			"--agent-id=" + n.name,
			"--proxy-server-host=127.0.0.1", "--proxy-server-port=" + strconv.Itoa(n.serverFwd.port),
			"--ca-cert=" + p.caCert, "--service-account-token-path=" + tokenFile,
			"--health-server-host=127.0.0.1", "--health-server-port=" + strconv.Itoa(freePort(t)),
			"--admin-bind-address=127.0.0.1", "--admin-server-port=" + strconv.Itoa(freePort(t)),
			"--sync-interval=200ms", "--sync-interval-cap=1s", "--drain-timeout=2s",
		}, extra...)
		n.agent = &agent{id: n.name, proc: startProcEnv(t, "ip", "agent-"+n.name, nil, args...)}
	}
	for _, n := range nodes {
		startNodeAgent(n)
	}
	s.waitAgents(t, 2, 60*time.Second)
	t.Logf("node-routing: control plane, server, two agents in their namespaces up in %v", time.Since(start).Round(100*time.Millisecond))

	// --- node first: every call succeeds, each through its node's agent.
	checks := nodeChecks(e, nodes)
	waitNodeChecks(t, checks, 90*time.Second)
	hitsBefore := backendHits(nodes, whSrv)
	for round := 1; round <= nodeRounds; round++ {
		for _, ck := range checks {
			if err := ck.run(round); err != nil {
				t.Fatalf("node,default: round %d: %s: %v", round, ck.name, err)
			}
		}
	}
	hits := backendHits(nodes, whSrv)
	for k, v := range hits {
		if v-hitsBefore[k] < nodeRounds {
			t.Errorf("node,default: %s reached %d times in %d rounds", k, v-hitsBefore[k], nodeRounds)
		}
	}
	t.Logf("node,default: %d rounds of %d checks all passed; backends reached from their own namespaces: %v", nodeRounds, len(checks), diffHits(hits, hitsBefore))
	metrics := fetchMetrics(t, s)
	t.Logf("node,default: %s", grepLines(metrics, "node_route_total"))
	if !strings.Contains(metrics, `node_route_total{result="routed"}`) {
		t.Errorf("no node_route_total{result=\"routed\"} in the server's metrics")
	}
	status := runStatus(t, fmt.Sprintf("127.0.0.1:%d", s.adminPort))
	for _, n := range nodes {
		if !strings.Contains(status, n.name+" ") || strings.Count(status, n.name) < 2 {
			t.Errorf("konnectivity status does not show agent %s serving node %s:\n%s", n.name, n.name, status)
		}
	}
	t.Logf("konnectivity status:\n%s", status)

	// --- Followed within a second: a Node added, its pod CIDR set, an
	// EndpointSlice updated, the Node deleted. A second server (no
	// agents, node alone) says in each 503 which node owns the address.
	probe := startProbeServer(t, dir, kubeconfig, p)
	followed := func(what, addr, want string, change func()) {
		t.Helper()
		// Timed from the apiserver's answer to the change: what follows
		// is the watch's delay.
		c0 := time.Now()
		change()
		t0, took := time.Now(), time.Since(c0)
		for {
			got := probe.reason(t, addr)
			if strings.Contains(got, want) {
				t.Logf("follow: %s: %s seen %v after the apiserver accepted the change (which took %v)", what, addr, time.Since(t0).Round(time.Millisecond), took.Round(time.Millisecond))
				if d := time.Since(t0); d > time.Second {
					t.Errorf("follow: %s took %v, want within a second", what, d)
				}
				return
			}
			if time.Since(t0) > 10*time.Second {
				t.Fatalf("follow: %s: %s still answers %q", what, addr, got)
			}
		}
	}
	probe.waitOwner(t, a.kubeletIP, `node "node-a"`)
	followed("Node added", "192.0.2.13", `node "node-c"`, func() {
		n := obj("Node", "v1", "node-c", "")
		c.create(t, "/api/v1/nodes", n)
		patchStatus(t, c, "/api/v1/nodes/node-c/status", map[string]any{"addresses": []any{map[string]any{"type": "InternalIP", "address": "192.0.2.13"}}})
	})
	followed("pod CIDR set", "10.244.2.7", `node "node-c"`, func() {
		patchObject(t, c, "/api/v1/nodes/node-c", map[string]any{"spec": map[string]any{"podCIDR": "10.244.2.0/24", "podCIDRs": []string{"10.244.2.0/24"}}})
	})
	slice := obj("EndpointSlice", "discovery.k8s.io/v1", "moving", kubeNS)
	slice["addressType"] = "IPv4"
	slice["endpoints"] = []any{map[string]any{"addresses": []string{"172.31.9.9"}, "nodeName": "node-a"}}
	c.create(t, "/apis/discovery.k8s.io/v1/namespaces/"+kubeNS+"/endpointslices", slice)
	probe.waitOwner(t, "172.31.9.9", `node "node-a"`)
	followed("EndpointSlice updated", "172.31.9.9", `node "node-c"`, func() {
		patchObject(t, c, "/apis/discovery.k8s.io/v1/namespaces/"+kubeNS+"/endpointslices/moving", map[string]any{
			"endpoints": []any{map[string]any{"addresses": []string{"172.31.9.9"}, "nodeName": "node-c"}},
		})
	})
	followed("Node deleted", "10.244.2.7", "no node the apiserver lists owns", func() {
		c.mustDo(t, http.StatusOK, http.MethodDelete, "/api/v1/nodes/node-c", nil)
	})
	for _, addr := range []string{"192.0.2.13", "172.31.9.9"} {
		if got := probe.reason(t, addr); !strings.Contains(got, "no node the apiserver lists owns") {
			t.Errorf("after node-c was deleted, %s: %q", addr, got)
		}
	}

	// --- default alone: a random agent, so about half the calls fail.
	s.proc.stop(t)
	s.args = serverArgs("default")
	s.launch(t)
	s.waitAgents(t, 2, 60*time.Second)
	failed, total := 0, 0
	for round := 1; round <= nodeRounds; round++ {
		for _, ck := range checks {
			total++
			if err := ck.run(1000 + round); err != nil {
				failed++
			}
		}
	}
	t.Logf("default alone: %d of %d calls failed (a random agent cannot reach the other node's addresses)", failed, total)

	// --- Own node only on node A's agent: with node B's agent gone, a
	// dial to node B's pod reaches node A's agent, which refuses it.
	for _, n := range nodes {
		n.agent.proc.stop(t)
	}
	s.waitAgents(t, 0, 30*time.Second)
	startNodeAgent(a, "--allow-destinations=node", "--node-name="+a.name, "--kubeconfig="+a.apiKubeconfig)
	s.waitAgents(t, 1, 60*time.Second)
	own := nodeCheck{name: "pods/proxy " + a.podName, run: func(int) error { return podProxy(c, a.podName, a.podSrv.port) }}
	waitNodeChecks(t, []nodeCheck{own}, 60*time.Second) // its own pod: allowed once its Node and Pods are read
	before := b.podSrv.hits.Load()
	err = podProxy(c, b.podName, b.podSrv.port)
	if err == nil || b.podSrv.hits.Load() != before {
		t.Errorf("own node only: node A's agent carried a dial to node B's pod (err %v)", err)
	}
	const refusal = "nor an address, pod CIDR or pod of this agent's node" // the log quotes the node name
	waitFor(t, 10*time.Second, "node A's agent logs the refusal", func() bool { return strings.Contains(a.agent.proc.out.String(), refusal) })
	t.Logf("own node only: node A's agent refused node B's pod: %s", tail(err.Error(), 300))
	t.Logf("node-routing: done in %v", time.Since(start).Round(100*time.Millisecond))
}

// nodeCheck is one call whose destination is on one node.
type nodeCheck struct {
	name string
	run  func(seq int) error
}

func nodeChecks(e *kubeEnv, nodes []*kubeNodeSpec) []nodeCheck {
	checks := []nodeCheck{{"webhook on node-b", e.checkWebhook}}
	for _, n := range nodes {
		checks = append(checks,
			nodeCheck{"pods/log " + n.podName, func(int) error { return podLog(e.c, n.podName) }},
			nodeCheck{"pods/exec " + n.podName, func(int) error {
				return upgradeEcho(e.c, "/api/v1/namespaces/"+kubeNS+"/pods/"+n.podName+"/exec?command=cat&stdin=true&stdout=true&container=app", "v4.channel.k8s.io", 64<<10)
			}},
			nodeCheck{"pods/proxy " + n.podName, func(int) error { return podProxy(e.c, n.podName, n.podSrv.port) }},
		)
	}
	return checks
}

// waitNodeChecks waits until every check passes once (the server's node
// map and the apiserver's caches catch up after a start).
func waitNodeChecks(t *testing.T, checks []nodeCheck, bound time.Duration) {
	t.Helper()
	for _, ck := range checks {
		t0 := time.Now()
		for {
			err := ck.run(0)
			if err == nil {
				break
			}
			if time.Since(t0) > bound {
				t.Fatalf("%s: not passing within %v: %v", ck.name, bound, err)
			}
			time.Sleep(300 * time.Millisecond)
		}
	}
}

func podLog(c *kubeCluster, pod string) error {
	code, body, err := c.do(http.MethodGet, "/api/v1/namespaces/"+kubeNS+"/pods/"+pod+"/log?container=app", nil)
	if err != nil {
		return err
	}
	if code != http.StatusOK || string(body) != kubeLogLines() {
		return fmt.Errorf("pods/log %s: status %d: %s", pod, code, tail(string(body), 300))
	}
	return nil
}

func podProxy(c *kubeCluster, pod string, port int) error {
	code, body, err := c.do(http.MethodGet, fmt.Sprintf("/api/v1/namespaces/%s/pods/https:%s:%d/proxy/hello", kubeNS, pod, port), nil)
	if err != nil {
		return err
	}
	if want := "pod " + pod + " /hello"; code != http.StatusOK || string(body) != want {
		return fmt.Errorf("pods/proxy %s: status %d: %s", pod, code, tail(string(body), 300))
	}
	return nil
}

func podHandler(name string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "pod %s %s", name, r.URL.Path)
	})
}

func backendHits(nodes []*kubeNodeSpec, wh *kubeBackend) map[string]int64 {
	m := map[string]int64{"webhook@node-b": wh.hits.Load()}
	for _, n := range nodes {
		m["kubelet@"+n.name] = n.kubeletSrv.hits.Load()
		m["pod@"+n.name] = n.podSrv.hits.Load()
	}
	return m
}

func diffHits(now, before map[string]int64) map[string]int64 {
	d := map[string]int64{}
	for k, v := range now {
		d[k] = v - before[k]
	}
	return d
}

func podOn(name, ns, sa, node string) map[string]any {
	p := pod(name, ns, sa)
	p["spec"].(map[string]any)["nodeName"] = node
	return p
}

func role(t *testing.T, c *kubeCluster, name string, rules []any) {
	r := obj("ClusterRole", "rbac.authorization.k8s.io/v1", name, "")
	r["rules"] = rules
	c.create(t, "/apis/rbac.authorization.k8s.io/v1/clusterroles", r)
}

func bind(t *testing.T, c *kubeCluster, name, roleName string, subject map[string]any) {
	crb := obj("ClusterRoleBinding", "rbac.authorization.k8s.io/v1", name, "")
	crb["roleRef"] = map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": roleName}
	crb["subjects"] = []any{subject}
	c.create(t, "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", crb)
}

func patchStatus(t *testing.T, c *kubeCluster, path string, status any) {
	t.Helper()
	patchObject(t, c, path, map[string]any{"status": status})
}

func patchObject(t *testing.T, c *kubeCluster, path string, patch any) {
	t.Helper()
	b, _ := json.Marshal(patch)
	req, err := http.NewRequest(http.MethodPatch, c.url+path, strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/merge-patch+json")
	resp, err := c.admin.Do(req)
	if err != nil {
		t.Fatalf("patch %s: %v", path, err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("patch %s: %d %s", path, resp.StatusCode, body)
	}
}

// serviceOnNode creates a selector-less Service with one endpoint at ip
// on node, as the endpoint controllers would (Endpoints and an
// EndpointSlice with nodeName).
func serviceOnNode(t *testing.T, c *kubeCluster, name, ip, node string, port int) {
	t.Helper()
	svc := obj("Service", "v1", name, kubeNS)
	svc["spec"] = map[string]any{"ports": []any{map[string]any{"name": "https", "port": 443, "targetPort": port, "protocol": "TCP"}}}
	c.create(t, "/api/v1/namespaces/"+kubeNS+"/services", svc)
	ep := obj("Endpoints", "v1", name, kubeNS)
	ep["subsets"] = []any{map[string]any{
		"addresses": []any{map[string]any{"ip": ip, "nodeName": node}},
		"ports":     []any{map[string]any{"name": "https", "port": port, "protocol": "TCP"}},
	}}
	c.create(t, "/api/v1/namespaces/"+kubeNS+"/endpoints", ep)
	es := obj("EndpointSlice", "discovery.k8s.io/v1", name+"-e2e", kubeNS)
	es["metadata"].(map[string]any)["labels"] = map[string]any{"kubernetes.io/service-name": name}
	es["addressType"] = "IPv4"
	es["endpoints"] = []any{map[string]any{"addresses": []string{ip}, "nodeName": node, "conditions": map[string]any{"ready": true}}}
	es["ports"] = []any{map[string]any{"name": "https", "port": port, "protocol": "TCP"}}
	c.create(t, "/apis/discovery.k8s.io/v1/namespaces/"+kubeNS+"/endpointslices", es)
}

// writeToken gets a token for the ServiceAccount konnectivity-agent bound
// to pod, for audience ("" is the apiserver's own).
func writeToken(t *testing.T, c *kubeCluster, dir, pod, audience string) string {
	t.Helper()
	spec := map[string]any{
		"expirationSeconds": 3600,
		"boundObjectRef":    map[string]any{"kind": "Pod", "apiVersion": "v1", "name": pod},
	}
	if audience != "" {
		spec["audiences"] = []string{audience}
	}
	tr := c.create(t, "/api/v1/namespaces/kube-system/serviceaccounts/konnectivity-agent/token", map[string]any{
		"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec,
	})
	var resp struct {
		Status struct {
			Token string `json:"token"`
		} `json:"status"`
	}
	if err := json.Unmarshal(tr, &resp); err != nil || resp.Status.Token == "" {
		t.Fatalf("TokenRequest for %s: no token (%v): %s", pod, err, tail(string(tr), 500))
	}
	return resp.Status.Token
}

// makeNetns creates a network namespace whose loopback interface holds
// addrs: a node's own addresses, reachable from nowhere else.
func makeNetns(t *testing.T, name string, addrs ...string) {
	t.Helper()
	cmds := [][]string{{"netns", "add", name}, {"-n", name, "link", "set", "lo", "up"}}
	for _, a := range addrs {
		cmds = append(cmds, []string{"-n", name, "addr", "add", a + "/32", "dev", "lo"})
	}
	for _, args := range cmds {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
}

// inNetns runs fn on a thread inside the named network namespace, so the
// sockets fn opens live there (and keep working from any thread after).
func inNetns(t *testing.T, name string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	var failure string
	go func() {
		defer close(done)
		runtime.LockOSThread()
		// The thread is dropped, not unlocked, if it cannot go back.
		self, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			failure = err.Error()
			return
		}
		defer self.Close()
		target, err := os.Open("/run/netns/" + name)
		if err != nil {
			failure = err.Error()
			return
		}
		defer target.Close()
		if err := setns(target); err != nil {
			failure = "setns " + name + ": " + err.Error()
			return
		}
		fn()
		if setns(self) == nil {
			runtime.UnlockOSThread()
		}
	}()
	<-done
	if failure != "" {
		t.Fatal(failure)
	}
}

func setns(f *os.File) error {
	return unix.Setns(int(f.Fd()), unix.CLONE_NEWNET)
}

// forwarder listens on 127.0.0.1 in a node's namespace and forwards each
// connection to its target, dialled from the test's namespace: an agent in
// a node's namespace reaches the server and the apiserver through it, and
// nothing else.
type forwarder struct {
	port   int
	target atomic.Value // string: host:port in the test's namespace
}

// forwardFromNetns starts a forwarder on the calling thread's namespace.
func forwardFromNetns(t *testing.T, target string) *forwarder {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &forwarder{port: ln.Addr().(*net.TCPAddr).Port}
	f.target.Store(target)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				d, err := net.DialTimeout("tcp", f.target.Load().(string), 5*time.Second)
				if err != nil {
					return
				}
				defer d.Close()
				go func() { io.Copy(d, c); d.(*net.TCPConn).CloseWrite() }()
				io.Copy(c, d)
			}()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return f
}

// probeServer is a konnectivity server with the node strategy alone and
// no agents: its 503s name the node that owns an address.
type probeServer struct{ sock string }

func startProbeServer(t *testing.T, dir, kubeconfig string, p *pki) *probeServer {
	t.Helper()
	pr := &probeServer{sock: filepath.Join(dir, "probe.socket")}
	s := &server{owner: t, dir: dir, pki: p, sock: pr.sock, agentPort: freePort(t), healthPort: freePort(t), adminPort: freePort(t)}
	s.args = []string{"server", "--mode=http-connect", "--uds-name=" + pr.sock, "--server-port=0",
		"--agent-bind-address=127.0.0.1", "--agent-port=" + strconv.Itoa(s.agentPort),
		"--cluster-cert=" + p.serverCert, "--cluster-key=" + p.serverKey,
		"--kubeconfig=" + kubeconfig, "--allow-unauthenticated-agents",
		"--proxy-strategies=node", "--agent-wait=50ms",
		"--health-bind-address=127.0.0.1", "--health-port=" + strconv.Itoa(s.healthPort),
		"--admin-bind-address=127.0.0.1", "--admin-port=" + strconv.Itoa(s.adminPort),
		"--readyz-requires-agent=false",
	}
	s.launch(t)
	return pr
}

// reason sends one CONNECT and returns the answer's status line and body.
func (pr *probeServer) reason(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.DialTimeout("unix", pr.sock, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "CONNECT %s:443 HTTP/1.1\r\nHost: %s:443\r\n\r\n", addr, addr)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return err.Error()
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 2048))
	return resp.Status + ": " + string(body)
}

// waitOwner waits until the probe says want owns addr (its first list).
func (pr *probeServer) waitOwner(t *testing.T, addr, want string) {
	t.Helper()
	waitFor(t, 30*time.Second, addr+" owned by "+want, func() bool { return strings.Contains(pr.reason(t, addr), want) })
}

func fetchMetrics(t *testing.T, s *server) string {
	t.Helper()
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", s.healthPort))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	return string(body)
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "; ")
}
