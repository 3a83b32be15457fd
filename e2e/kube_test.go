package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/tools/remotecommand"
)

// TestKubeAPIServer runs the server under a real kube-apiserver and etcd:
// the apiserver reads the egress selector file that images/ ships (only
// the socket path changed), admits the agent through its own TokenRequest
// and TokenReview APIs, and reaches a Service-referenced webhook, a
// kubelet (logs, exec, port-forward) and an aggregated API only through
// the tunnel.
//
// The backends need a non-loopback address (kube-apiserver refuses
// 127.0.0.0/8 in Endpoints and for node proxying), so the test re-runs
// itself in a new network namespace (unshare --net) where 192.0.2.1 (a
// documentation address) sits on the namespace's own loopback interface:
// nothing can leave the machine. That needs root; without it the test is
// skipped, and under CI=true it fails.
const (
	kubeNetnsEnv     = "KONNECTIVITY_KUBE_E2E_NETNS" // set inside the namespace
	kubeAPIServerEnv = "KONNECTIVITY_KUBE_APISERVER"
	kubeEtcdEnv      = "KONNECTIVITY_KUBE_ETCD"
	kubeNodeIP       = "192.0.2.1"
	kubeNode         = "kube-e2e-node"
	kubeNS           = "e2e"
)

func TestKubeAPIServer(t *testing.T) {
	if os.Getenv(kubeNetnsEnv) != "" {
		kubeInNamespace(t)
		return
	}
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatalf("needs root for a private network namespace (euid %d); CI must run this test", os.Geteuid())
		}
		t.Skipf("needs root for a private network namespace (euid %d); set CI=true to make this a failure", os.Geteuid())
	}
	for _, tool := range []string{"unshare", "ip", "go"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("needs %s: %v", tool, err)
		}
	}
	apiserver, etcd := buildKubeBinaries(t)
	upstreamAgent := upstreamAgentBin(t)

	// Run this test again, alone, as PID 1 of new network, PID and mount
	// namespaces: when it ends, the kernel kills whatever it left behind.
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	run := "^TestKubeAPIServer$"
	if f := flag.Lookup("test.run"); f != nil && strings.Contains(f.Value.String(), "/") {
		run = "^TestKubeAPIServer$/" + f.Value.String()[strings.Index(f.Value.String(), "/")+1:]
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	args := []string{"--net", "--pid", "--mount", "--mount-proc", "--fork", "--kill-child",
		self, "-test.run=" + run, "-test.count=1", "-test.v", "-test.timeout=19m"}
	if f := flag.Lookup("test.skip"); f != nil && f.Value.String() != "" {
		args = append(args, "-test.skip="+f.Value.String())
	}
	cmd := exec.CommandContext(ctx, "unshare", args...)
	cmd.Env = append(os.Environ(),
		kubeNetnsEnv+"=1",
		kubeAPIServerEnv+"="+apiserver,
		kubeEtcdEnv+"="+etcd,
		kubeUpstreamAgentEnv+"="+upstreamAgent,
		"KONNECTIVITY_BIN="+konnectivityBin)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := cmd.Run(); err != nil {
		t.Fatalf("the test in its network namespace failed after %v: %v", time.Since(start).Round(time.Second), err)
	}
	t.Logf("the test in its network namespace passed in %v", time.Since(start).Round(time.Second))
}

// kubeInNamespace is the test proper, inside the private namespaces.
func kubeInNamespace(t *testing.T) {
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"addr", "add", kubeNodeIP + "/32", "dev", "lo"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	// Only lo may exist here: a fresh namespace has no route out.
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range ifs {
		if i.Flags&net.FlagLoopback == 0 {
			t.Fatalf("interface %s in the test's network namespace: not a private namespace", i.Name)
		}
	}
	apiserver, etcd := os.Getenv(kubeAPIServerEnv), os.Getenv(kubeEtcdEnv)
	for _, mode := range []string{"http-connect", "grpc"} {
		t.Run(mode, func(t *testing.T) { kubeMode(t, apiserver, etcd, mode) })
	}
	t.Run("node-routing", func(t *testing.T) { kubeNodeRouting(t, apiserver, etcd) })
	t.Run("manifests-dry-run", func(t *testing.T) { kubeDryRunShipped(t, apiserver, etcd) })
}

// kubeEnv is one mode's control plane, konnectivity pair and backends.
type kubeEnv struct {
	mode      string
	c         *kubeCluster
	s         *server
	agentArgs []string
	agent     *agent
	reviews   atomic.Int64 // admission reviews the webhook answered
	kubelet   *kubeletStandIn
}

func kubeMode(t *testing.T, apiserverBin, etcdBin, mode string) {
	start := time.Now()
	e := &kubeEnv{mode: mode, kubelet: &kubeletStandIn{}}
	dir, err := os.MkdirTemp("", "kse2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "konnectivity-server.socket")
	egress := egressConfigFor(t, dir, sock, mode)
	nodeIP := net.ParseIP(kubeNodeIP)
	e.c = startKubeCluster(t, apiserverBin, etcdBin, egress, nodeIP)
	c := e.c

	// --- Objects a controller-manager, kubelet and scheduler would make.
	c.create(t, "/api/v1/namespaces", obj("Namespace", "v1", kubeNS, ""))
	for _, ns := range []string{"kube-system", kubeNS} {
		sa := "default"
		if ns == "kube-system" {
			sa = "konnectivity-agent"
		}
		c.create(t, "/api/v1/namespaces/"+ns+"/serviceaccounts", obj("ServiceAccount", "v1", sa, ns))
	}
	// The server's kubeconfig identity may review tokens and nothing else.
	srvCert, srvKey, _ := c.pki.issue(t, "konnectivity-server-client", true, "system:konnectivity-server", nil, nil, nil)
	crb := obj("ClusterRoleBinding", "rbac.authorization.k8s.io/v1", "konnectivity-server-auth-delegator", "")
	crb["roleRef"] = map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:auth-delegator"}
	crb["subjects"] = []any{map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:konnectivity-server"}}
	c.create(t, "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", crb)

	kubeletSrv := startKubeBackend(t, kubeNodeIP, c.pki.serving(t, "kubelet", nil, []net.IP{nodeIP}), e.kubelet)
	node := obj("Node", "v1", kubeNode, "")
	c.create(t, "/api/v1/nodes", node)
	node["status"] = map[string]any{
		"addresses":       []any{map[string]any{"type": "InternalIP", "address": kubeNodeIP}},
		"daemonEndpoints": map[string]any{"kubeletEndpoint": map[string]any{"Port": kubeletSrv.port}},
		"conditions":      []any{map[string]any{"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": time.Now().UTC().Format(time.RFC3339)}},
	}
	e.patchNodeStatus(t, node["status"])
	// The agent's own Pod (its token is bound to it) and the workload Pod
	// whose logs, exec and port-forward go to the kubelet stand-in.
	c.create(t, "/api/v1/namespaces/kube-system/pods", pod("konnectivity-agent-"+kubeNode, "kube-system", "konnectivity-agent"))
	c.create(t, "/api/v1/namespaces/"+kubeNS+"/pods", pod("target", kubeNS, "default"))
	c.create(t, "/api/v1/namespaces/"+kubeNS+"/pods", pod(kubeForwardPod, kubeNS, "default"))

	// --- The agent's token from the real TokenRequest API, bound to its Pod.
	tr := c.create(t, "/api/v1/namespaces/kube-system/serviceaccounts/konnectivity-agent/token", map[string]any{
		"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
		"spec": map[string]any{
			"audiences":         []string{agentAudience},
			"expirationSeconds": 3600,
			"boundObjectRef":    map[string]any{"kind": "Pod", "apiVersion": "v1", "name": "konnectivity-agent-" + kubeNode},
		},
	})
	var trResp struct {
		Status struct {
			Token string `json:"token"`
		} `json:"status"`
	}
	if err := json.Unmarshal(tr, &trResp); err != nil || trResp.Status.Token == "" {
		t.Fatalf("TokenRequest: no token (%v): %s", err, tail(string(tr), 500))
	}
	tokenFile := filepath.Join(dir, "agent-token")
	if err := os.WriteFile(tokenFile, []byte(trResp.Status.Token), 0o600); err != nil {
		t.Fatal(err)
	}

	// --- The server with the production flags (openrc/konnectivity-server.initd).
	kubeconfig := filepath.Join(dir, "kubeconfig")
	c.writeKubeconfig(t, kubeconfig, srvCert, srvKey)
	p := newPKI(t, dir)
	e.s = &server{
		owner:      t,
		dir:        dir,
		pki:        p,
		sock:       sock,
		agentPort:  freePort(t),
		healthPort: freePort(t),
		adminPort:  freePort(t),
	}
	e.s.args = []string{"server",
		"--mode=" + mode,
		"--uds-name=" + sock, "--server-port=0",
		"--agent-bind-address=127.0.0.1",
		"--agent-port=" + strconv.Itoa(e.s.agentPort),
		"--cluster-cert=" + p.serverCert,
		"--cluster-key=" + p.serverKey,
		"--kubeconfig=" + kubeconfig,
		"--authentication-audience=" + agentAudience,
		"--agent-namespace=kube-system",
		"--agent-service-account=konnectivity-agent",
		"--proxy-strategies=destHost,default",
		"--health-bind-address=127.0.0.1",
		"--health-port=" + strconv.Itoa(e.s.healthPort),
		"--admin-bind-address=127.0.0.1",
		"--admin-port=" + strconv.Itoa(e.s.adminPort),
		"--agent-wait=2s",
		"--graceful-shutdown-timeout=2s",
	}
	e.s.launch(t)
	e.agentArgs = []string{
		"--proxy-server-host=127.0.0.1",
		"--proxy-server-port=" + strconv.Itoa(e.s.agentPort),
		"--ca-cert=" + p.caCert,
		"--service-account-token-path=" + tokenFile,
		"--agent-identifiers=host=" + kubeNode,
		"--sync-interval=200ms", "--sync-interval-cap=1s",
		"--drain-timeout=2s",
	}
	e.startAgent(t)

	// --- A Service-referenced validating webhook, failurePolicy Fail.
	whSrv := startKubeBackend(t, kubeNodeIP, c.pki.serving(t, "webhook", []string{"webhook." + kubeNS + ".svc"}, nil), webhookHandler(&e.reviews))
	e.service(t, "webhook", whSrv.port)
	createConfigMapWebhook(t, c, "konnectivity-e2e")

	// --- An aggregated API behind a Service.
	aggSrv := startKubeBackend(t, kubeNodeIP, c.pki.serving(t, "aggregated", []string{"api." + kubeNS + ".svc"}, nil), aggregatedHandler())
	e.service(t, "api", aggSrv.port)
	aps := obj("APIService", "apiregistration.k8s.io/v1", aggVersion+"."+aggGroup, "")
	aps["spec"] = map[string]any{
		"group": aggGroup, "version": aggVersion,
		"service":              map[string]any{"namespace": kubeNS, "name": "api", "port": 443},
		"caBundle":             base64.StdEncoding.EncodeToString(c.pki.caPEM(t)),
		"groupPriorityMinimum": 1000, "versionPriority": 15,
	}
	c.create(t, "/apis/apiregistration.k8s.io/v1/apiservices", aps)
	t.Logf("%s: control plane, server, agent and backends up in %v", mode, time.Since(start).Round(100*time.Millisecond))

	// --- Every path works through the tunnel.
	e.waitAll(t, "with the agent connected", 90*time.Second, nil)
	e.followLogs(t)
	if e.reviews.Load() == 0 || kubeletSrv.hits.Load() == 0 || aggSrv.hits.Load() == 0 {
		t.Fatalf("a backend was never reached: webhook %d, kubelet %d, aggregated %d",
			e.reviews.Load(), kubeletSrv.hits.Load(), aggSrv.hits.Load())
	}
	e.checkKubeletRequests(t)

	// --- With the agent stopped every path fails as the apiserver reports
	// a dead egress; the backends are still up and directly reachable
	// from here, so only the tunnel can be missing.
	e.agent.proc.stop(t)
	e.s.waitAgents(t, 0, 10*time.Second)
	before := kubeletSrv.hits.Load() + aggSrv.hits.Load() + e.reviews.Load()
	e.waitAll(t, "with the agent stopped", 90*time.Second, e.expectDeadEgress)
	if after := kubeletSrv.hits.Load() + aggSrv.hits.Load() + e.reviews.Load(); after != before {
		t.Fatalf("backends were reached %d times with no agent connected", after-before)
	}

	// --- The agent comes back: every path works again, same apiserver.
	e.startAgent(t)
	e.waitAll(t, "with the agent back (apiserver not restarted)", 120*time.Second, nil)

	// --- SIGHUP restarts of the server in the middle of webhook calls.
	t.Run("sighup-webhook-loop", e.webhookLoopAcrossRestarts)

	// --- SIGHUP restarts of the agent in the middle of a followed log
	// and webhook calls (before the rollouts, whose agents end with
	// their subtest).
	t.Run("agent-sighup-logs-webhook", e.logsAndWebhookAcrossAgentRestarts)

	// --- Agent rollouts (SIGTERM, then a new agent) in the middle of
	// webhook calls.
	t.Run("agent-rollout-webhook-loop", e.webhookLoopAcrossAgentRollouts)

	// --- Upstream's proxy-agent as its DaemonSet runs it, with the
	// pod-bound token.
	t.Run("upstream-agent-pod-token", e.upstreamAgentPodToken)

	// --- Orderly stop: kube-apiserver holds idle keep-alive connections
	// through the tunnel; SIGTERM must still end agent and server within
	// their grace periods.
	for _, p := range []*proc{e.agent.proc, e.s.proc} {
		t0 := time.Now()
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
			t.Logf("%s: %s exited %v after SIGTERM (%v)", mode, p.name, time.Since(t0).Round(10*time.Millisecond), p.waitErr)
		case <-time.After(10 * time.Second):
			t.Errorf("%s: %s still running 10s after SIGTERM; output tail:\n%s", mode, p.name, tail(p.out.String(), 3000))
		}
	}
	t.Logf("%s: done in %v", mode, time.Since(start).Round(100*time.Millisecond))
}

func obj(kind, apiVersion, name, ns string) map[string]any {
	md := map[string]any{"name": name}
	if ns != "" {
		md["namespace"] = ns
	}
	return map[string]any{"apiVersion": apiVersion, "kind": kind, "metadata": md}
}

func pod(name, ns, sa string) map[string]any {
	p := obj("Pod", "v1", name, ns)
	p["spec"] = map[string]any{
		"nodeName":                     kubeNode,
		"serviceAccountName":           sa,
		"automountServiceAccountToken": false,
		"containers": []any{
			map[string]any{"name": "app", "image": "example.invalid/app"},
			map[string]any{"name": kubeExecContainer, "image": "example.invalid/shell"},
		},
	}
	return p
}

func (e *kubeEnv) patchNodeStatus(t *testing.T, status any) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"status": status})
	req, err := http.NewRequest(http.MethodPatch, e.c.url+"/api/v1/nodes/"+kubeNode+"/status", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/merge-patch+json")
	resp, err := e.c.admin.Do(req)
	if err != nil {
		t.Fatalf("patch node status: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("patch node status: %d %s", resp.StatusCode, body)
	}
}

// service creates a selector-less Service named name in kubeNS with its
// Endpoints and EndpointSlice pointing at kubeNodeIP:port, as the
// endpoint controllers would.
func (e *kubeEnv) service(t *testing.T, name string, port int) {
	t.Helper()
	c := e.c
	svc := obj("Service", "v1", name, kubeNS)
	svc["spec"] = map[string]any{"ports": []any{map[string]any{"name": "https", "port": 443, "targetPort": port, "protocol": "TCP"}}}
	c.create(t, "/api/v1/namespaces/"+kubeNS+"/services", svc)
	ep := obj("Endpoints", "v1", name, kubeNS)
	ep["subsets"] = []any{map[string]any{
		"addresses": []any{map[string]any{"ip": kubeNodeIP}},
		"ports":     []any{map[string]any{"name": "https", "port": port, "protocol": "TCP"}},
	}}
	c.create(t, "/api/v1/namespaces/"+kubeNS+"/endpoints", ep)
	es := obj("EndpointSlice", "discovery.k8s.io/v1", name+"-e2e", kubeNS)
	es["metadata"].(map[string]any)["labels"] = map[string]any{"kubernetes.io/service-name": name}
	es["addressType"] = "IPv4"
	es["endpoints"] = []any{map[string]any{"addresses": []string{kubeNodeIP}, "conditions": map[string]any{"ready": true}}}
	es["ports"] = []any{map[string]any{"name": "https", "port": port, "protocol": "TCP"}}
	c.create(t, "/apis/discovery.k8s.io/v1/namespaces/"+kubeNS+"/endpointslices", es)
}

func (e *kubeEnv) startAgent(t *testing.T) {
	t.Helper()
	e.agent = startAgentArgs(t, kubeNode, e.agentArgs...)
	waitHTTP(t, e.agent.proc, e.agent.healthURL("/readyz"), http.StatusOK)
	e.s.waitAgents(t, 1, startTimeout)
}

// kubeCheck is one path through the tunnel; it returns nil when the bytes
// came back right, else what the apiserver said.
type kubeCheck struct {
	name string
	run  func(e *kubeEnv, seq int) error
}

var kubeChecks = []kubeCheck{
	{"webhook", (*kubeEnv).checkWebhook},
	{"pods/log", (*kubeEnv).checkLogs},
	{"pods/exec", func(e *kubeEnv, _ int) error {
		return upgradeEcho(e.c, "/api/v1/namespaces/"+kubeNS+"/pods/target/exec?command=cat&stdin=true&stdout=true&container=app",
			"v4.channel.k8s.io", 256<<10)
	}},
	{"pods/exec (kubectl's WebSocket)", (*kubeEnv).checkExecWebSocket},
	{"pods/portforward", func(e *kubeEnv, _ int) error {
		return upgradeEcho(e.c, "/api/v1/namespaces/"+kubeNS+"/pods/target/portforward?ports=8080",
			"portforward.k8s.io", 256<<10)
	}},
	{"pods/portforward (kubectl's WebSocket)", (*kubeEnv).checkPortForwardWebSocket},
	{"aggregated API", (*kubeEnv).checkAggregated},
}

// waitAll polls every check until each passes (want == nil) or each fails
// as want accepts, within bound.
func (e *kubeEnv) waitAll(t *testing.T, when string, bound time.Duration, want func(name string, err error) error) {
	t.Helper()
	seq := 0
	for _, ck := range kubeChecks {
		start := time.Now()
		var last error
		for {
			seq++
			err := ck.run(e, seq)
			if want == nil && err == nil {
				break
			}
			if want != nil && err != nil {
				if last = want(ck.name, err); last == nil {
					t.Logf("%s %s: %s fails as expected: %s", e.mode, when, ck.name, tail(err.Error(), 300))
					break
				}
			} else if want != nil {
				last = fmt.Errorf("succeeded")
			} else {
				last = err
			}
			if time.Since(start) > bound {
				t.Fatalf("%s %s: %s: not as expected within %v; last: %v", e.mode, when, ck.name, bound, last)
			}
			time.Sleep(500 * time.Millisecond)
		}
		if want == nil {
			t.Logf("%s %s: %s ok after %v", e.mode, when, ck.name, time.Since(start).Round(10*time.Millisecond))
		}
	}
}

// expectDeadEgress accepts the apiserver's report of a failed egress dial:
// for HTTPConnect the egress dialer's "proxy error ... code 503" carrying
// the server's refusal, for GRPC konnectivity-client's dial failure, which
// is the server's DIAL_RSP error text. The aggregator may instead answer
// 503 for an APIService its availability check (through the same dead
// egress) marked unavailable.
func (e *kubeEnv) expectDeadEgress(name string, err error) error {
	msg := err.Error()
	marks := []string{"no agent available"}
	if e.mode == "http-connect" {
		marks = []string{"proxy error", "code 503"}
	}
	hasMarks := true
	for _, m := range marks {
		hasMarks = hasMarks && strings.Contains(msg, m)
	}
	if hasMarks {
		return nil
	}
	if name == "aggregated API" && strings.Contains(msg, "status 503") &&
		(strings.Contains(msg, "unable to handle the request") || strings.Contains(msg, "service unavailable")) {
		return nil
	}
	return fmt.Errorf("error lacks %q: %s", marks, tail(msg, 600))
}

func (e *kubeEnv) checkWebhook(seq int) error {
	c := e.c
	name := fmt.Sprintf("deny-%s-%d", strings.ReplaceAll(e.mode, "-", ""), seq)
	code, body, err := c.do(http.MethodPost, "/api/v1/namespaces/"+kubeNS+"/configmaps", obj("ConfigMap", "v1", name, kubeNS))
	if err != nil {
		return err
	}
	if code != http.StatusForbidden || !strings.Contains(string(body), "e2e webhook denies "+name) {
		return fmt.Errorf("create %s: status %d: %s", name, code, tail(string(body), 600))
	}
	ok := fmt.Sprintf("ok-%s-%d", strings.ReplaceAll(e.mode, "-", ""), seq)
	code, body, err = c.do(http.MethodPost, "/api/v1/namespaces/"+kubeNS+"/configmaps", obj("ConfigMap", "v1", ok, kubeNS))
	if err != nil {
		return err
	}
	if code != http.StatusCreated {
		return fmt.Errorf("create %s: status %d: %s", ok, code, tail(string(body), 600))
	}
	return nil
}

func (e *kubeEnv) checkLogs(int) error {
	code, body, err := e.c.do(http.MethodGet, "/api/v1/namespaces/"+kubeNS+"/pods/target/log?container=app", nil)
	if err != nil {
		return err
	}
	if code != http.StatusOK {
		return fmt.Errorf("pods/log: status %d: %s", code, tail(string(body), 600))
	}
	if want := kubeLogLines(); string(body) != want {
		return fmt.Errorf("pods/log: %d bytes (sha %s), want %d (sha %s)", len(body), sha(body), len(want), sha([]byte(want)))
	}
	return nil
}

func (e *kubeEnv) checkAggregated(seq int) error {
	name := fmt.Sprintf("echo-%d", seq)
	path := "/apis/" + aggGroup + "/" + aggVersion + "/namespaces/" + kubeNS + "/echoes/" + name
	code, body, err := e.c.do(http.MethodGet, path, nil)
	if err != nil {
		return err
	}
	if code != http.StatusOK {
		return fmt.Errorf("aggregated GET: status %d: %s", code, tail(string(body), 600))
	}
	var got struct {
		Path string `json:"path"`
	}
	if err := json.Unmarshal(body, &got); err != nil || got.Path != path {
		return fmt.Errorf("aggregated GET: answer %s, want path %s", tail(string(body), 300), path)
	}
	return nil
}

// openFollowLogs starts GET pods/log?follow=true on the target pod's app
// container, as kubectl logs -f does, for as long as ctx lasts, and fails
// the test unless it answers 200; the caller reads and closes the body.
func (e *kubeEnv) openFollowLogs(t *testing.T, ctx context.Context) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.c.url+"/api/v1/namespaces/"+kubeNS+"/pods/target/log?container=app&follow=true", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := e.c.admin.Do(req)
	if err != nil {
		t.Fatalf("follow logs: %v", err)
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		t.Fatalf("follow logs: status %d: %s", resp.StatusCode, b)
	}
	return resp
}

// followLogs streams pods/log?follow=true for 3 seconds and checks the
// lines arrive in order, as the kubelet stand-in writes them.
func (e *kubeEnv) followLogs(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	resp := e.openFollowLogs(t, ctx)
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	n := 0
	for sc.Scan() {
		if want := fmt.Sprintf("follow %d", n); sc.Text() != want {
			t.Fatalf("follow logs: line %q, want %q", sc.Text(), want)
		}
		n++
	}
	// 3s at one line per 100ms: well over half must have streamed in.
	if n < 15 {
		t.Fatalf("follow logs: %d lines in 3s, want ≥15 (err %v)", n, sc.Err())
	}
	t.Logf("%s: pods/log follow=true streamed %d lines in order over 3s", e.mode, n)
}

// checkKubeletRequests: the stand-in saw the kubelet API paths the
// apiserver derives from the Pod and Node.
func (e *kubeEnv) checkKubeletRequests(t *testing.T) {
	t.Helper()
	want := []string{
		"/containerLogs/" + kubeNS + "/target/app",
		"/exec/" + kubeNS + "/target/app?",
		"/exec/" + kubeNS + "/target/" + kubeExecContainer + "?",
		"/portForward/" + kubeNS + "/target",
		"/portForward/" + kubeNS + "/" + kubeForwardPod,
	}
	seen := strings.Join(e.kubelet.seen(), "\n")
	for _, w := range want {
		if !strings.Contains(seen, w) {
			t.Fatalf("kubelet stand-in never saw %s; saw:\n%s", w, seen)
		}
	}
}

// kubeRestarts is how many SIGHUP restarts webhookLoopAcrossRestarts makes.
const kubeRestarts = 2

// webhookLoopAcrossRestarts sends webhook-checked creates from two
// goroutines while the server re-executes itself on SIGHUP, kubeRestarts
// times, each restart complete before the next. Every call must succeed
// and every restart must hand its paused tunnels to the next image.
func (e *kubeEnv) webhookLoopAcrossRestarts(t *testing.T) {
	t.Helper()
	out0 := len(e.s.proc.out.String()) // the server's output before this subtest
	reviews0 := e.reviews.Load()
	stop := e.webhookLoop("loop")
	pid := e.s.proc.cmd.Process.Pid
	for i := range kubeRestarts {
		time.Sleep(time.Second)
		execs := strings.Count(e.s.proc.out.String(), "re-executing in place")
		e.s.proc.signal(t, syscall.SIGHUP)
		// The draining server pauses each kube-apiserver tunnel and
		// hands it over; then the same process re-executes, the agent
		// rejoins it and the tunnels resume.
		waitFor(t, 30*time.Second, fmt.Sprintf("re-exec after SIGHUP #%d", i+1), func() bool {
			return strings.Count(e.s.proc.out.String(), "re-executing in place") > execs
		})
		waitFor(t, 20*time.Second, fmt.Sprintf("agent back after SIGHUP #%d", i+1), func() bool {
			return e.s.agentCount() == 1
		})
	}
	time.Sleep(time.Second)
	ok, failed, errs := stop()
	if e.s.proc.exited() || e.s.proc.cmd.Process.Pid != pid {
		t.Fatalf("server process changed across SIGHUP")
	}
	t.Logf("%s: %d webhook-checked creates across %d SIGHUP restarts, %d failed, webhook answered %d",
		e.mode, ok, kubeRestarts, failed, e.reviews.Load()-reviews0)
	// A restart pauses each kube-apiserver tunnel at a byte-exact point
	// with the agent and hands the client's socket (with gRPC, its frozen
	// HTTP/2 connection too) to the next image, which resumes it on a new
	// stream: kube-apiserver's connection never closes, so no call may be
	// lost, each restart must say it handed tunnels over (kube-apiserver
	// keeps at least one keep-alive connection to the webhook open under
	// this load), and none may fail to pause or resume.
	if failed > 0 || ok < 10 {
		t.Fatalf("webhook loop across SIGHUP: %d ok, %d failed: %s", ok, failed, strings.Join(errs, "\n"))
	}
	out := e.s.proc.out.String()[out0:]
	for line := range strings.Lines(out) {
		if strings.Contains(line, "tunnels paused for the next image") {
			t.Logf("%s: %s", e.mode, strings.TrimSpace(line))
		}
	}
	if n := strings.Count(out, "paused tunnels handed to the next image"); n != kubeRestarts {
		t.Errorf("server handed paused tunnels to the next image %d times across %d restarts, want once per restart:\n%s", n, kubeRestarts, tail(out, 6000))
	}
	for _, bad := range []string{"could not be resumed", "could not be paused"} {
		if line := lineWith(out, bad); line != "" {
			t.Errorf("a tunnel %s across SIGHUP: %s", bad, line)
		}
	}
}

// webhookLoop sends webhook-checked creates from two goroutines until
// the returned stop is called (webhookCreateLoop).
func (e *kubeEnv) webhookLoop(prefix string) (stop func() (ok, failed int64, errs []string)) {
	stopLoop := webhookCreateLoop(e.c, kubeNS, prefix+"-"+strings.ReplaceAll(e.mode, "-", ""))
	return func() (int64, int64, []string) {
		r := stopLoop()
		return r.ok, r.failed, r.errs
	}
}

// createLoopResult is what a webhookCreateLoop did: creates that passed and
// failed, the failures kube-apiserver reported as no agent being connected
// (the konnectivity server's "no agent available"), and the first failures.
type createLoopResult struct {
	ok, failed, noAgent int64
	errs                []string
}

// webhookCreateLoop creates ConfigMaps in ns (each checked by a webhook)
// from two goroutines, one call at a time each, until the returned stop is
// called.
func webhookCreateLoop(c *kubeCluster, ns, prefix string) (stop func() createLoopResult) {
	var (
		okN, failedN, noAgentN atomic.Int64
		mu                     sync.Mutex
		first                  []string
		done                   = make(chan struct{})
		wg                     sync.WaitGroup
	)
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-done:
					return
				default:
				}
				name := fmt.Sprintf("%s-%d-%d", prefix, w, i)
				code, body, err := c.do(http.MethodPost, "/api/v1/namespaces/"+ns+"/configmaps", obj("ConfigMap", "v1", name, ns))
				if err == nil && code == http.StatusCreated {
					okN.Add(1)
					continue
				}
				failedN.Add(1)
				if strings.Contains(string(body), "no agent available") {
					noAgentN.Add(1)
				}
				mu.Lock()
				if len(first) < 5 {
					first = append(first, fmt.Sprintf("%s: %d %v %s", name, code, err, tail(string(body), 300)))
				}
				mu.Unlock()
			}
		}()
	}
	return func() createLoopResult {
		close(done)
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return createLoopResult{ok: okN.Load(), failed: failedN.Load(), noAgent: noAgentN.Load(), errs: first}
	}
}

// webhookLoopAcrossAgentRollouts rolls agents under a loop of webhook
// creates, as a DaemonSet rollout does: with two agents up (IDs the node
// and the agent's pod, both allowed by its token), each in turn gets
// SIGTERM and, once it exited, a new agent with its ID starts and joins.
// A draining agent tells the server, which steers new dials to the other
// agent and closes the draining agent's idle keep-alive tunnels at a quiet
// moment, so kube-apiserver dials again instead of finding its connection
// cut at the agent's --drain-timeout. On HTTP CONNECT a call that races
// a quiet close is mostly retried by kube-apiserver's HTTP client (the
// socket is closed before it wrote), but one whose connection the client
// picked as it closed is lost: the loop makes one call at a time, so at
// most one per rollout may be lost there. On gRPC such a race loses the
// call more often (konnectivity-client accepts the write until it has
// read the CLOSE_RSP), so the count is reported, not asserted.
func (e *kubeEnv) webhookLoopAcrossAgentRollouts(t *testing.T) {
	podID := "konnectivity-agent-" + kubeNode
	other := startAgentArgs(t, podID, e.agentArgs...)
	waitHTTP(t, other.proc, other.healthURL("/readyz"), http.StatusOK)
	e.s.waitAgents(t, 2, startTimeout)
	reviews0 := e.reviews.Load()
	stop := e.webhookLoop("roll")
	agents := []*agent{e.agent, other}
	ids := []string{kubeNode, podID}
	var cuts []string // the agents' "drain timeout" lines: tunnels they cut
	for i := range agents {
		time.Sleep(time.Second)
		t0 := time.Now()
		agents[i].proc.stop(t)
		drained := time.Since(t0)
		if line := lineWith(agents[i].proc.out.String(), "drain timeout: closing open tunnels"); line != "" {
			cuts = append(cuts, ids[i]+": "+strings.TrimSpace(line))
		}
		agents[i] = startAgentArgs(t, ids[i], e.agentArgs...)
		waitHTTP(t, agents[i].proc, agents[i].healthURL("/readyz"), http.StatusOK)
		e.s.waitAgents(t, 2, startTimeout)
		t.Logf("%s: agent %s drained and exited in %v, its successor joined", e.mode, ids[i], drained.Round(10*time.Millisecond))
	}
	time.Sleep(time.Second)
	ok, failed, errs := stop()
	e.agent = agents[0]
	agents[1].proc.stop(t) // one agent again, as the steps after this expect
	e.s.waitAgents(t, 1, startTimeout)
	t.Logf("%s: %d webhook-checked creates across %d agent rollouts, %d lost, webhook answered %d",
		e.mode, ok, len(agents), failed, e.reviews.Load()-reviews0)
	for _, c := range cuts {
		t.Logf("%s: a draining agent cut tunnels at its --drain-timeout: %s", e.mode, c)
	}
	if ok < 10 {
		t.Fatalf("webhook loop across agent rollouts: only %d creates passed, %d failed: %s", ok, failed, strings.Join(errs, "\n"))
	}
	switch {
	case failed > 0 && e.mode == "grpc":
		t.Logf("%s: creates lost across agent rollouts (a call racing a quiet close, or on a tunnel the agent cut): %s", e.mode, strings.Join(errs, "\n"))
	case failed > int64(len(agents)):
		t.Errorf("webhook loop across agent rollouts: %d ok, %d lost, more than one per rollout: %s", ok, failed, strings.Join(errs, "\n"))
	case failed > 0:
		t.Logf("%s: %d create(s) lost across %d agent rollouts, at most one per rollout (a call racing the quiet close of its connection): %s", e.mode, failed, len(agents), strings.Join(errs, "\n"))
	}
}

// checkExecWebSocket runs exec as kubectl 1.37 does (client-go's WebSocket
// executor, v5.channel.k8s.io): kube-apiserver translates it into SPDY
// streams toward a kubelet that does not declare ExtendWebSocketsToKubelet,
// through the tunnel. 128 KiB go to stdin and must come back on stdout.
func (e *kubeEnv) checkExecWebSocket(int) error {
	cfg := e.restConfig()
	u := e.c.url + "/api/v1/namespaces/" + kubeNS + "/pods/target/exec?container=" + kubeExecContainer +
		"&command=cat&stdin=true&stdout=true"
	ex, err := remotecommand.NewWebSocketExecutor(cfg, http.MethodGet, u)
	if err != nil {
		return err
	}
	want := pattern(128 << 10)
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdin: bytes.NewReader(want), Stdout: &out}); err != nil {
		return fmt.Errorf("websocket exec: %w", err)
	}
	if sha(out.Bytes()) != sha(want) {
		return fmt.Errorf("websocket exec: stdout %d bytes (sha %s), want %d (sha %s)", out.Len(), sha(out.Bytes()), len(want), sha(want))
	}
	return nil
}

// restConfig is the admin's client-go configuration.
func (e *kubeEnv) restConfig() *rest.Config { return e.c.restConfig() }

// restConfig is the admin's client-go configuration.
func (c *kubeCluster) restConfig() *rest.Config {
	return &rest.Config{
		Host: c.url,
		TLSClientConfig: rest.TLSClientConfig{
			CAFile: c.pki.caFile, CertFile: c.adminCert, KeyFile: c.adminKey,
		},
	}
}

// checkPortForwardWebSocket forwards a local port as kubectl 1.37 does
// (SPDY tunnelled in a WebSocket to kube-apiserver, which passes the SPDY
// connection on to the kubelet stand-in through the tunnel) and echoes
// 128 KiB through it.
func (e *kubeEnv) checkPortForwardWebSocket(int) error {
	return portForwardEcho(e.restConfig(), e.c.url+"/api/v1/namespaces/"+kubeNS+"/pods/"+kubeForwardPod+"/portforward", 8080, 128<<10)
}

// portForwardEcho forwards a local port to port of the pod at podURL (its
// portforward subresource) as kubectl 1.37 does and checks that n bytes
// written come back unchanged.
func portForwardEcho(cfg *rest.Config, podURL string, port, n int) error {
	u, err := url.Parse(podURL)
	if err != nil {
		return err
	}
	d, err := portforward.NewSPDYOverWebsocketDialer(u, cfg)
	if err != nil {
		return err
	}
	stop, ready := make(chan struct{}), make(chan struct{})
	var errOut bytes.Buffer
	pf, err := portforward.NewOnAddresses(d, []string{"127.0.0.1"}, []string{"0:" + strconv.Itoa(port)}, stop, ready, io.Discard, &errOut)
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- pf.ForwardPorts() }()
	defer func() {
		close(stop)
		<-done
	}()
	select {
	case <-ready:
	case err := <-done:
		done <- err // for the deferred receive
		return fmt.Errorf("websocket port-forward: %w", err)
	case <-time.After(30 * time.Second):
		return fmt.Errorf("websocket port-forward: not ready in 30s")
	}
	ports, err := pf.GetPorts()
	if err != nil || len(ports) != 1 {
		return fmt.Errorf("websocket port-forward: ports %v, %v", ports, err)
	}
	c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(ports[0].Local))), 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	want := pattern(n)
	werr := make(chan error, 1)
	go func() {
		_, err := c.Write(want)
		werr <- err
	}()
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("websocket port-forward: read echo: %w (write: %v; %s)", err, <-werr, errOut.String())
	}
	if err := <-werr; err != nil {
		return fmt.Errorf("websocket port-forward: write: %w", err)
	}
	if sha(got) != sha(want) {
		return fmt.Errorf("websocket port-forward: echo differs")
	}
	return nil
}

// createConfigMapWebhook registers the Service "webhook" in kubeNS as a
// validating webhook, failurePolicy Fail, for every ConfigMap created in
// kubeNS: kube-apiserver reaches it only through konnectivity.
func createConfigMapWebhook(t *testing.T, c *kubeCluster, name string) {
	t.Helper()
	vwc := obj("ValidatingWebhookConfiguration", "admissionregistration.k8s.io/v1", name, "")
	vwc["webhooks"] = []any{map[string]any{
		"name":                    "configmaps.e2e.konnectivity.test",
		"admissionReviewVersions": []string{"v1"},
		"sideEffects":             "None",
		"failurePolicy":           "Fail",
		"timeoutSeconds":          10,
		"clientConfig": map[string]any{
			"service":  map[string]any{"namespace": kubeNS, "name": "webhook", "path": "/validate", "port": 443},
			"caBundle": base64.StdEncoding.EncodeToString(c.pki.caPEM(t)),
		},
		"rules": []any{map[string]any{
			"apiGroups": []string{""}, "apiVersions": []string{"v1"},
			"operations": []string{"CREATE"}, "resources": []string{"configmaps"},
		}},
		"namespaceSelector": map[string]any{"matchLabels": map[string]any{"kubernetes.io/metadata.name": kubeNS}},
	}}
	c.create(t, "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations", vwc)
}

// logsAndWebhookAcrossAgentRestarts follows a pod's log (kubectl logs -f:
// GET pods/log?follow=true, one numbered line every 100ms from the kubelet)
// and sends webhook-checked creates from two goroutines while the agent
// re-executes itself on SIGHUP, kubeRestarts times: the agent hands its
// tunnels to its next image (docs/restart.md, "An agent's restart"), so
// the log goes on with no line lost or repeated on the same stream, and no
// create fails.
func (e *kubeEnv) logsAndWebhookAcrossAgentRestarts(t *testing.T) {
	agentOut0, srvOut0 := len(e.agent.proc.out.String()), len(e.s.proc.out.String())
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Second)
	defer cancel()
	resp := e.openFollowLogs(t, ctx)
	defer resp.Body.Close()
	var lines atomic.Int64
	logErr := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if want := fmt.Sprintf("follow %d", lines.Load()); sc.Text() != want {
				logErr <- fmt.Errorf("line %q, want %q", sc.Text(), want)
				return
			}
			lines.Add(1)
		}
		logErr <- fmt.Errorf("log stream ended after %d lines: %v", lines.Load(), sc.Err())
	}()
	waitFor(t, 10*time.Second, "the followed log streaming", func() bool { return lines.Load() >= 5 })
	reviews0 := e.reviews.Load()
	stop := e.webhookLoop("ahup")
	pid := e.agent.proc.cmd.Process.Pid
	for i := range kubeRestarts {
		time.Sleep(time.Second)
		execs := strings.Count(e.agent.proc.out.String(), "re-executing in place")
		before := lines.Load()
		at := time.Now()
		e.agent.proc.signal(t, syscall.SIGHUP)
		waitFor(t, 20*time.Second, fmt.Sprintf("agent re-exec after SIGHUP #%d", i+1), func() bool {
			return strings.Count(e.agent.proc.out.String(), "re-executing in place") > execs
		})
		waitFor(t, 10*time.Second, fmt.Sprintf("the followed log going on after SIGHUP #%d", i+1), func() bool {
			return lines.Load() >= before+5
		})
		t.Logf("%s: agent SIGHUP #%d: the followed log went on after %v", e.mode, i+1, time.Since(at).Round(10*time.Millisecond))
	}
	time.Sleep(time.Second)
	ok, failed, errs := stop()
	select {
	case err := <-logErr:
		t.Errorf("followed log across agent SIGHUPs: %v", err)
	default:
	}
	cancel()
	if e.agent.proc.exited() || e.agent.proc.cmd.Process.Pid != pid {
		t.Fatalf("agent process changed across SIGHUP")
	}
	t.Logf("%s: %d log lines followed and %d webhook-checked creates across %d agent SIGHUPs, %d failed, webhook answered %d",
		e.mode, lines.Load(), ok, kubeRestarts, failed, e.reviews.Load()-reviews0)
	if failed > 0 || ok < 10 {
		t.Errorf("webhook loop across agent SIGHUPs: %d ok, %d failed: %s", ok, failed, strings.Join(errs, "\n"))
	}
	agentOut := e.agent.proc.out.String()[agentOut0:]
	if n := strings.Count(agentOut, "destinations of paused tunnels handed to the next image"); n != kubeRestarts {
		t.Errorf("agent handed kept destinations to its next image %d times across %d SIGHUPs, want once per SIGHUP:\n%s", n, kubeRestarts, tail(agentOut, 6000))
	}
	srvOut := e.s.proc.out.String()[srvOut0:]
	for _, bad := range []string{"could not be resumed", "could not be paused"} {
		if line := lineWith(srvOut, bad); line != "" {
			t.Errorf("a tunnel %s across an agent SIGHUP: %s", bad, line)
		}
	}
}
