package e2e

// One cluster of TestRealCluster: kube-apiserver and etcd (kube_cluster_test.go)
// with the egress file images/ ships, kube-controller-manager,
// kube-scheduler and a kubelet on the namespace's containerd; the server as
// the init script starts it, the agent as the shipped DaemonSet, and pods of
// the test's own images.

import (
	"bufio"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	k8syaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

const (
	shippedAgentDaemonSet = "../images/eks-node/var/lib/rancher/k3s/server/manifests/konnectivity-agent.yaml"
	shippedServerInitd    = "../openrc/konnectivity-server.initd"
	// Where the init script writes the agents' ConfigMap by default (k3s's
	// auto-deploy folder, on this namespace's /var/lib tmpfs); the test
	// applies it as k3s would.
	initdAgentConfigManifest = "/var/lib/rancher/k3s/server/manifests/konnectivity-agent-config.yaml"
	// The init script's default health port.
	initdHealthPort = 8134
	// The kubelet's static pod folder, as docs/kube-apiserver.md names it
	// (on a tmpfs in the test's mount namespace).
	clusterStaticPodDir = "/etc/kubernetes/manifests"
)

// clusterEnv is one cluster: its control plane, node and konnectivity.
type clusterEnv struct {
	name    string // the cluster's, in logs and paths
	mode    string // the egress mode: http-connect or grpc
	n       *clusterNodeEnv
	c       *kubeCluster
	dir     string
	kubelet *proc
	srv     *server // the server the init script runs on the host
}

func clusterMode(t *testing.T, n *clusterNodeEnv, mode string) {
	start := time.Now()
	e := startCluster(t, n, mode, mode, "")
	e.startServerAsInitd(t)
	t0 := time.Now()
	e.applyAgentDaemonSet(t)
	e.waitAgentPod(t, "")
	e.srv.waitAgents(t, 1, 60*time.Second)
	t.Logf("%s: agent DaemonSet pod Ready and connected %v after apply", mode, time.Since(t0).Round(100*time.Millisecond))

	t0 = time.Now()
	e.deployWebhook(t)
	e.deployWorkload(t)
	t.Logf("%s: webhook and workload pods Running, webhook answering through the tunnel, %v after create", mode, time.Since(t0).Round(100*time.Millisecond))

	t.Run("node-image", e.nodeImageStory)
	t.Run("rollouts", e.rolloutsUnderLoad)
	e.teardown(t)
	e.srv.proc.stop(t)
	t.Logf("%s: done in %v", mode, time.Since(start).Round(100*time.Millisecond))
}

// startCluster starts a control plane whose kube-apiserver reads egress
// (the shipped node-image file for mode when ""), and the node; extra
// flags go to kube-apiserver.
func startCluster(t *testing.T, n *clusterNodeEnv, name, mode, egress string, extra ...string) *clusterEnv {
	t.Helper()
	start := time.Now()
	dir, err := os.MkdirTemp("", "kce2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	e := &clusterEnv{name: name, mode: mode, n: n, dir: dir}
	if egress == "" {
		egress = egressConfigFor(t, dir, shippedSocket, mode)
	}
	e.c = startKubeCluster(t, filepath.Join(n.kubeDir, "kube-apiserver"), filepath.Join(n.kubeDir, "etcd"), egress, net.ParseIP(clusterNodeIP), extra...)
	e.startControllers(t)
	e.startKubelet(t)
	e.waitNodeReady(t, clusterNode, e.kubelet)
	t.Logf("%s: control plane and node %s Ready in %v", name, clusterNode, time.Since(start).Round(100*time.Millisecond))
	return e
}

// kubeconfigFor writes a kubeconfig with a client certificate for user
// (and groups) and returns its path.
func (e *clusterEnv) kubeconfigFor(t *testing.T, name, user string, groups ...string) string {
	t.Helper()
	cert, key, _ := e.c.pki.issue(t, name, true, user, groups, nil, nil)
	p := filepath.Join(e.dir, name+".kubeconfig")
	e.c.writeKubeconfig(t, p, cert, key)
	return p
}

func (e *clusterEnv) startControllers(t *testing.T) {
	t.Helper()
	kcm := e.kubeconfigFor(t, "kube-controller-manager", "system:kube-controller-manager")
	startKubeProc(t, filepath.Join(e.n.kubeDir, "kube-controller-manager"), "kube-controller-manager",
		"--kubeconfig="+kcm,
		"--authentication-kubeconfig="+kcm,
		"--authorization-kubeconfig="+kcm,
		"--bind-address=127.0.0.1",
		"--secure-port="+strconv.Itoa(freePort(t)),
		"--leader-elect=false",
		"--root-ca-file="+e.c.pki.caFile,
		"--service-account-private-key-file="+filepath.Join(e.c.dir, "sa.key"),
		"--use-service-account-credentials=true",
		"--controllers=daemonset,endpoint,endpointslice,serviceaccount,root-ca-cert-publisher,garbagecollector,podgc,nodelifecycle",
		"--profiling=false",
		"--v=1",
	)
	sched := e.kubeconfigFor(t, "kube-scheduler", "system:kube-scheduler")
	startKubeProc(t, filepath.Join(e.n.kubeDir, "kube-scheduler"), "kube-scheduler",
		"--kubeconfig="+sched,
		"--authentication-kubeconfig="+sched,
		"--authorization-kubeconfig="+sched,
		"--bind-address=127.0.0.1",
		"--secure-port="+strconv.Itoa(freePort(t)),
		"--leader-elect=false",
		"--profiling=false",
		"--v=1",
	)
}

// clusterKubelet is one node's kubelet: its name, address, cgroup root,
// the kube-apiserver URL it uses, and the command that enters its node's
// namespaces ("" for the test's own).
type clusterKubelet struct {
	node, ip, cgroupRoot, apiserver string
	enter                           []string
}

func (e *clusterEnv) startKubelet(t *testing.T) {
	t.Helper()
	e.kubelet = e.startNodeKubelet(t, clusterKubelet{node: clusterNode, ip: clusterNodeIP, cgroupRoot: e.n.cgroupRoot, apiserver: e.c.url})
}

// startNodeKubelet starts a kubelet on k's node with a client and a serving
// certificate of the cluster CA.
func (e *clusterEnv) startNodeKubelet(t *testing.T, k clusterKubelet) *proc {
	t.Helper()
	nodeIP := net.ParseIP(k.ip)
	cert, key, _ := e.c.pki.issue(t, "kubelet-client-"+k.node, true, "system:node:"+k.node, []string{"system:nodes"}, nil, nil)
	kc := filepath.Join(e.dir, k.node+".kubeconfig")
	writeKubeconfigFile(t, kc, k.apiserver, e.c.pki.caFile, fmt.Sprintf("{client-certificate: %q, client-key: %q}", cert, key))
	servingCert, servingKey, _ := e.c.pki.issue(t, "kubelet-"+k.node, false, k.node, nil, []string{k.node}, []net.IP{nodeIP})
	resolv := filepath.Join(e.dir, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver "+k.ip+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	staticPods := clusterStaticPodDir
	if len(k.enter) > 0 {
		staticPods = filepath.Join(e.dir, k.node+"-manifests")
	}
	if err := os.MkdirAll(staticPods, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %q
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: %q
tlsPrivateKeyFile: %q
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %q}
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: unix://%s
cgroupDriver: cgroupfs
cgroupRoot: %q
failCgroupV1: false
failSwapOn: false
staticPodPath: %q
resolvConf: %q
syncFrequency: 10s
fileCheckFrequency: 2s
nodeStatusUpdateFrequency: 2s
maxPods: 20
serializeImagePulls: false
evictionHard: {"memory.available": "1Mi", "nodefs.available": "1%%", "imagefs.available": "1%%", "nodefs.inodesFree": "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
`, k.ip, servingCert, servingKey, e.c.pki.caFile, containerdSock, k.cgroupRoot, staticPods, resolv)
	cfgFile := filepath.Join(e.dir, k.node+"-kubelet.yaml")
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append(append([]string{}, k.enter...), filepath.Join(e.n.kubeDir, "kubelet"),
		"--config="+cfgFile,
		"--kubeconfig="+kc,
		"--root-dir=/var/lib/kubelet-"+e.name,
		"--hostname-override="+k.node,
		"--node-ip="+k.ip,
		"--v=1",
	)
	return startKubeProc(t, args[0], "kubelet "+k.node, args[1:]...)
}

// waitNodeReady waits until node, whose kubelet is k, is Ready.
func (e *clusterEnv) waitNodeReady(t *testing.T, node string, k *proc) {
	t.Helper()
	waitFor(t, 2*time.Minute, "node "+node+" Ready", func() bool {
		if k.exited() {
			t.Fatalf("kubelet exited: %v\n%s", k.waitErr, tail(k.out.String(), 8000))
		}
		var n struct {
			Status struct {
				Conditions []struct{ Type, Status string } `json:"conditions"`
			} `json:"status"`
		}
		if !e.get("/api/v1/nodes/"+node, &n) {
			return false
		}
		for _, c := range n.Status.Conditions {
			if c.Type == "Ready" {
				return c.Status == "True"
			}
		}
		return false
	})
}

// get GETs path as the admin into v; false on any error or status but 200.
func (e *clusterEnv) get(path string, v any) bool {
	code, body, err := e.c.do(http.MethodGet, path, nil)
	if err != nil || code != http.StatusOK {
		return false
	}
	return json.Unmarshal(body, v) == nil
}

// startServerAsInitd starts the server with the command line
// openrc/konnectivity-server.initd builds in start_pre (its defaults, with
// what /etc/conf.d/konnectivity-server would set: the mode, the CA that
// signs the serving certificate, the kubeconfig for TokenReview and the
// SANs), then applies the agents' ConfigMap manifest the script wrote, as
// k3s's auto-deploy does.
func (e *clusterEnv) startServerAsInitd(t *testing.T, env ...string) {
	t.Helper()
	caKey := e.writeCAKey(t)
	kubeconfig := filepath.Join(e.dir, "admin.kubeconfig")
	e.c.writeKubeconfig(t, kubeconfig, e.c.adminCert, e.c.adminKey)
	if err := os.MkdirAll(filepath.Dir(initdAgentConfigManifest), 0o755); err != nil {
		t.Fatal(err)
	}
	initd, err := filepath.Abs(shippedServerInitd)
	if err != nil {
		t.Fatal(err)
	}
	// openrc-run's helpers, as far as start_pre uses them.
	script := `eerror() { echo "ERROR: $*" >&2; }
einfo() { :; }
checkpath() { while [ $# -gt 0 ]; do case $1 in -d) shift;; -m|-o) shift 2;; *) mkdir -p "$1"; shift;; esac; done; }
. "$1"
start_pre >&2 || exit 1
printf '%s\n' "$command_args"`
	cmd := exec.Command("sh", "-c", script, "sh", initd)
	cmd.Env = append(os.Environ(),
		"RC_SVCNAME=konnectivity-server",
		"KONNECTIVITY_BIN="+konnectivityBin,
		"KONNECTIVITY_MODE="+e.mode,
		"KONNECTIVITY_CA_CERT="+e.c.pki.caFile,
		"KONNECTIVITY_CA_KEY="+caKey,
		"KONNECTIVITY_KUBECONFIG="+kubeconfig,
		"KONNECTIVITY_SANS="+clusterNodeIP,
		"KONNECTIVITY_WAIT_SECONDS=5",
	)
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("the init script's start_pre: %v\n%s%s", err, out, stderr)
	}
	args := strings.Fields(string(out))
	t.Logf("%s: the init script runs: %s %s", e.mode, konnectivityBin, strings.Join(args, " "))
	e.srv = &server{owner: t, args: args, sock: shippedSocket, healthPort: initdHealthPort, agentPort: 8132, adminPort: 8133}
	e.srv.launch(t)
	e.applyManifest(t, initdAgentConfigManifest, nil)
}

// manifestObject is one object of a YAML manifest.
type manifestObject struct {
	kind, name, ns string
	json           []byte
}

// manifestObjects reads the objects of a YAML file, after replace
// (old → new pairs, each of which must occur).
func manifestObjects(t *testing.T, path string, replace []string) []manifestObject {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	for i := 0; i+1 < len(replace); i += 2 {
		if !strings.Contains(s, replace[i]) {
			t.Fatalf("%s: no %q to replace", path, replace[i])
		}
		s = strings.ReplaceAll(s, replace[i], replace[i+1])
	}
	var objs []manifestObject
	d := k8syaml.NewYAMLReader(bufio.NewReader(strings.NewReader(s)))
	for {
		doc, err := d.Read()
		if err != nil {
			break
		}
		j, err := yaml.YAMLToJSON(doc)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		var o struct {
			Kind     string                           `json:"kind"`
			Metadata struct{ Name, Namespace string } `json:"metadata"`
		}
		if err := json.Unmarshal(j, &o); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if o.Kind != "" { // else a document of comments only
			objs = append(objs, manifestObject{kind: o.Kind, name: o.Metadata.Name, ns: o.Metadata.Namespace, json: j})
		}
	}
	return objs
}

// writeCAKey writes the cluster CA's key (which k3s keeps on its servers
// and `konnectivity cert` mints from) and returns its path.
func (e *clusterEnv) writeCAKey(t *testing.T) string {
	t.Helper()
	caKey := filepath.Join(e.dir, "kube-ca.key")
	der, err := x509.MarshalPKCS8PrivateKey(e.c.pki.caKey)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, caKey, "PRIVATE KEY", der)
	return caKey
}

// applyManifest creates every object of a YAML file, after replace.
func (e *clusterEnv) applyManifest(t *testing.T, path string, replace []string) {
	t.Helper()
	for _, o := range manifestObjects(t, path, replace) {
		e.c.create(t, resourcePath(t, o.kind, o.ns), o.json)
	}
}

// deleteManifest deletes every object of a YAML file by name, as
// `kubectl delete -f` does, and expects each to exist.
func (e *clusterEnv) deleteManifest(t *testing.T, path string) {
	t.Helper()
	for _, o := range manifestObjects(t, path, nil) {
		e.c.mustDo(t, http.StatusOK, http.MethodDelete, resourcePath(t, o.kind, o.ns)+"/"+o.name+"?propagationPolicy=Background", nil)
	}
}

// resourcePath is the collection path of kind in ns.
func resourcePath(t *testing.T, kind, ns string) string {
	t.Helper()
	paths := map[string]string{
		"ServiceAccount":     "/api/v1/namespaces/%s/serviceaccounts",
		"ConfigMap":          "/api/v1/namespaces/%s/configmaps",
		"Secret":             "/api/v1/namespaces/%s/secrets",
		"Service":            "/api/v1/namespaces/%s/services",
		"Pod":                "/api/v1/namespaces/%s/pods",
		"DaemonSet":          "/apis/apps/v1/namespaces/%s/daemonsets",
		"ClusterRole":        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
		"ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
	}
	p, ok := paths[kind]
	if !ok {
		t.Fatalf("no path known for kind %s", kind)
	}
	if strings.Contains(p, "%s") {
		return fmt.Sprintf(p, ns)
	}
	return p
}

// applyAgentDaemonSet applies the shipped DaemonSet manifest with the image
// tag of the archive that was imported (as images/build-overlay.sh does).
func (e *clusterEnv) applyAgentDaemonSet(t *testing.T) {
	t.Helper()
	tag := e.n.agentImage[strings.LastIndex(e.n.agentImage, ":")+1:]
	e.applyManifest(t, shippedAgentDaemonSet, []string{"@VERSION@", tag})
}

// agentPod is the DaemonSet's pod on the node: its name, UID and whether it
// is Ready.
type clusterPod struct {
	Metadata struct {
		Name              string            `json:"name"`
		UID               string            `json:"uid"`
		Labels            map[string]string `json:"labels"`
		DeletionTimestamp *string           `json:"deletionTimestamp"`
	} `json:"metadata"`
	Spec struct {
		NodeName string `json:"nodeName"`
	} `json:"spec"`
	Status struct {
		Phase             string                                           `json:"phase"`
		PodIP             string                                           `json:"podIP"`
		HostIP            string                                           `json:"hostIP"`
		Conditions        []struct{ Type, Status, Reason, Message string } `json:"conditions"`
		ContainerStatuses []struct {
			Name         string `json:"name"`
			RestartCount int    `json:"restartCount"`
			ContainerID  string `json:"containerID"`
			State        struct {
				Waiting *struct{ Reason, Message string } `json:"waiting"`
			} `json:"state"`
		} `json:"containerStatuses"`
	} `json:"status"`
}

func (p *clusterPod) ready() bool {
	for _, c := range p.Status.Conditions {
		if c.Type == "Ready" {
			return c.Status == "True"
		}
	}
	return false
}

// pods lists the pods of ns matching selector.
func (e *clusterEnv) pods(t *testing.T, ns, selector string) []clusterPod {
	t.Helper()
	var list struct {
		Items []clusterPod `json:"items"`
	}
	if !e.get("/api/v1/namespaces/"+ns+"/pods?labelSelector="+selector, &list) {
		return nil
	}
	return list.Items
}

// waitAgentPod waits for one Ready agent pod other than notUID and returns
// its name.
func (e *clusterEnv) waitAgentPod(t *testing.T, notUID string) clusterPod {
	t.Helper()
	var got clusterPod
	var last string
	deadline := time.Now().Add(2 * time.Minute)
	for {
		for _, p := range e.pods(t, "kube-system", "k8s-app%3Dkonnectivity-agent") {
			if p.Metadata.UID != notUID && p.Metadata.DeletionTimestamp == nil && p.ready() {
				got = p
			}
			b, _ := json.Marshal(p.Status)
			last = string(b)
		}
		if got.Metadata.Name != "" {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("no Ready agent pod after 2m; last status %s\nkubelet:\n%s", last, tail(e.kubelet.out.String(), 6000))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// waitPodRunning waits until pod ns/name is Ready and returns it.
func (e *clusterEnv) waitPodReady(t *testing.T, ns, name string) clusterPod {
	t.Helper()
	var p clusterPod
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if e.get("/api/v1/namespaces/"+ns+"/pods/"+name, &p) && p.ready() {
			return p
		}
		if time.Now().After(deadline) {
			b, _ := json.Marshal(p.Status)
			t.Fatalf("pod %s/%s not Ready after 2m: %s\nkubelet:\n%s", ns, name, b, tail(e.kubelet.out.String(), 6000))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// deployWebhook runs the webhook image in a pod behind the Service
// "webhook" and registers it for ConfigMap creates in the e2e namespace
// (createConfigMapWebhook: failurePolicy Fail), then waits until a create
// passes through it.
func (e *clusterEnv) deployWebhook(t *testing.T) {
	t.Helper()
	c := e.c
	c.create(t, "/api/v1/namespaces", obj("Namespace", "v1", clusterNS, ""))
	waitFor(t, time.Minute, "ServiceAccount e2e/default", func() bool {
		var v any
		return e.get("/api/v1/namespaces/"+clusterNS+"/serviceaccounts/default", &v)
	})
	cert, key, _ := c.pki.issue(t, "webhook", false, "webhook", nil, []string{"webhook." + clusterNS + ".svc"}, nil)
	read := func(p string) string {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return base64.StdEncoding.EncodeToString(b)
	}
	sec := obj("Secret", "v1", "webhook-tls", clusterNS)
	sec["type"] = "kubernetes.io/tls"
	sec["data"] = map[string]any{"tls.crt": read(cert), "tls.key": read(key)}
	c.create(t, "/api/v1/namespaces/"+clusterNS+"/secrets", sec)
	p := obj("Pod", "v1", "webhook", clusterNS)
	p["metadata"].(map[string]any)["labels"] = map[string]any{"app": "webhook"}
	p["spec"] = map[string]any{
		"automountServiceAccountToken":  false,
		"terminationGracePeriodSeconds": 1,
		"containers": []any{map[string]any{
			"name": "webhook", "image": clusterWebhookImage, "imagePullPolicy": "Never",
			"ports":        []any{map[string]any{"containerPort": 8443}},
			"volumeMounts": []any{map[string]any{"name": "tls", "mountPath": "/tls", "readOnly": true}},
		}},
		"volumes": []any{map[string]any{"name": "tls", "secret": map[string]any{"secretName": "webhook-tls"}}},
	}
	c.create(t, "/api/v1/namespaces/"+clusterNS+"/pods", p)
	svc := obj("Service", "v1", "webhook", clusterNS)
	svc["spec"] = map[string]any{
		"selector": map[string]any{"app": "webhook"},
		"ports":    []any{map[string]any{"name": "https", "port": 443, "targetPort": 8443, "protocol": "TCP"}},
	}
	c.create(t, "/api/v1/namespaces/"+clusterNS+"/services", svc)
	e.waitPodReady(t, clusterNS, "webhook")
	createConfigMapWebhook(t, c, "konnectivity-e2e")
	var last string
	waitFor(t, time.Minute, "a create admitted by the webhook pod", func() bool {
		code, body, err := c.do(http.MethodPost, "/api/v1/namespaces/"+clusterNS+"/configmaps", obj("ConfigMap", "v1", fmt.Sprintf("first-%d", time.Now().UnixNano()), clusterNS))
		last = fmt.Sprintf("%d %v %s", code, err, tail(string(body), 300))
		return err == nil && code == http.StatusCreated
	})
	_ = last
}

// deployWorkload runs the workload pod: "app" logs a numbered line every
// 100ms and echoes TCP on 8080; "shell" copies its stdin to stdout.
func (e *clusterEnv) deployWorkload(t *testing.T) {
	t.Helper()
	p := obj("Pod", "v1", "workload", clusterNS)
	p["spec"] = map[string]any{
		"automountServiceAccountToken":  false,
		"terminationGracePeriodSeconds": 1,
		"containers": []any{
			map[string]any{"name": "app", "image": clusterWorkImage, "imagePullPolicy": "Never"},
			map[string]any{"name": "shell", "image": clusterWorkImage, "imagePullPolicy": "Never",
				"command": []string{"/clusterpod", "cat"}, "stdin": true},
		},
	}
	e.c.create(t, "/api/v1/namespaces/"+clusterNS+"/pods", p)
	e.waitPodReady(t, clusterNS, "workload")
}

// teardown deletes what runs in pods (the agent DaemonSet by its label, the
// way the docs tell), waits until the kubelet has stopped every container,
// and stops the kubelet, controllers and server; kube-apiserver and etcd
// stop with the test.
func (e *clusterEnv) teardown(t *testing.T) {
	t.Helper()
	start := time.Now()
	c := e.c
	c.mustDo(t, http.StatusOK, http.MethodDelete, "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/konnectivity-e2e", nil)
	c.mustDo(t, http.StatusOK, http.MethodDelete, "/api/v1/namespaces/"+clusterNS+"/pods?gracePeriodSeconds=1", nil)
	e.deleteAgents(t)
	waitFor(t, 90*time.Second, "every container stopped by the kubelet", func() bool {
		return len(containerTasks(t)) == 0
	})
	e.kubelet.stop(t)
	t.Logf("%s: pods deleted, their containers stopped and the kubelet stopped in %v", e.mode, time.Since(start).Round(100*time.Millisecond))
}

// deleteAgents deletes every object labelled k8s-app=konnectivity-agent in
// kube-system, as `kubectl delete -n kube-system -l k8s-app=konnectivity-agent
// daemonset,serviceaccount,configmap` does, and waits until the agent pods
// are gone.
func (e *clusterEnv) deleteAgents(t *testing.T) {
	t.Helper()
	for _, coll := range []string{
		"/apis/apps/v1/namespaces/kube-system/daemonsets",
		"/api/v1/namespaces/kube-system/serviceaccounts",
		"/api/v1/namespaces/kube-system/configmaps",
	} {
		e.c.mustDo(t, http.StatusOK, http.MethodDelete, coll+"?labelSelector=k8s-app%3Dkonnectivity-agent&propagationPolicy=Background", nil)
	}
	waitFor(t, 90*time.Second, "agent pods gone", func() bool {
		return len(e.pods(t, "kube-system", "k8s-app%3Dkonnectivity-agent")) == 0
	})
}

// agentPID is the PID (in this namespace) of the agent process in the
// running agent container.
func agentPID(t *testing.T, containerID string) int {
	t.Helper()
	id := strings.TrimPrefix(containerID, "containerd://")
	pid, ok := containerTasks(t)[id]
	if !ok || pid == 0 {
		t.Fatalf("no running task for agent container %s", id)
	}
	return pid
}

// signalPID sends sig to pid.
func signalPID(t *testing.T, pid int, sig syscall.Signal) {
	t.Helper()
	if err := syscall.Kill(pid, sig); err != nil {
		t.Fatalf("kill -%v %d: %v", sig, pid, err)
	}
}
