package e2e

// The bootstrap story of TestRealCluster: the server as the static pod
// images/control-plane ships, run by the kubelet on the control-plane node
// beside kube-apiserver, whose egress file is the one shipped beside it; the
// agents as the DaemonSet; webhooks in pods; then the teardown
// docs/kube-apiserver.md gives, after which nothing of konnectivity is left.

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const (
	shippedStaticPod      = "../images/control-plane/konnectivity-server.yaml"
	shippedStaticEgress   = "../images/control-plane/egress-selector-configuration.yaml"
	shippedClusterObjects = "../images/control-plane/konnectivity-cluster.yaml"
	// The host folder the static pod reads its kubeconfig and serving pair
	// from.
	staticPodConfigDir = "/etc/kubernetes/konnectivity-server"
)

func clusterBootstrap(t *testing.T, n *clusterNodeEnv) {
	start := time.Now()
	// kube-apiserver reads the shipped file as it is: its socket is the
	// static pod's hostPath, on this namespace's /run.
	egress, err := filepath.Abs(shippedStaticEgress)
	if err != nil {
		t.Fatal(err)
	}
	e := startCluster(t, n, "bootstrap", "http-connect", egress)
	c := e.c

	// The host files the static pod reads.
	if err := os.MkdirAll(staticPodConfigDir, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(staticPodConfigDir) })
	// The kubeconfig holds its certificates: the pod sees no other file.
	cert, key, _ := c.pki.issue(t, "konnectivity-server", true, "system:konnectivity-server", nil, nil, nil)
	inline := func(p string) string {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return base64.StdEncoding.EncodeToString(b)
	}
	writeKubeconfigFile(t, filepath.Join(staticPodConfigDir, "kubeconfig"), c.url, c.pki.caFile,
		fmt.Sprintf("{client-certificate-data: %s, client-key-data: %s}", inline(cert), inline(key)))
	kcb, err := os.ReadFile(filepath.Join(staticPodConfigDir, "kubeconfig"))
	if err != nil {
		t.Fatal(err)
	}
	kcs := strings.Replace(string(kcb), fmt.Sprintf("certificate-authority: %q", c.pki.caFile), "certificate-authority-data: "+inline(c.pki.caFile), 1)
	if kcs == string(kcb) {
		t.Fatal("kubeconfig: no certificate-authority to inline")
	}
	if err := os.WriteFile(filepath.Join(staticPodConfigDir, "kubeconfig"), []byte(kcs), 0o600); err != nil {
		t.Fatal(err)
	}
	caKey := e.writeCAKey(t)
	if out, err := exec.Command(konnectivityBin, "cert", "-dir", staticPodConfigDir, "-ca-cert", c.pki.caFile, "-ca-key", caKey,
		"-cn", "konnectivity-server", "-sans", clusterNodeIP).CombinedOutput(); err != nil {
		t.Fatalf("konnectivity cert: %v\n%s", err, out)
	}

	// The cluster objects (agents dial the node's address) and the agents,
	// then the static pod.
	e.applyManifest(t, shippedClusterObjects, []string{"proxy-server-host: control-plane.example", "proxy-server-host: " + clusterNodeIP})
	e.applyAgentDaemonSet(t)
	tag := n.agentImage[strings.LastIndex(n.agentImage, ":")+1:]
	manifest, err := os.ReadFile(shippedStaticPod)
	if err != nil {
		t.Fatal(err)
	}
	staticPod := filepath.Join(clusterStaticPodDir, "konnectivity-server.yaml")
	t0 := time.Now()
	if err := os.WriteFile(staticPod, []byte(strings.ReplaceAll(string(manifest), "@VERSION@", tag)), 0o644); err != nil {
		t.Fatal(err)
	}
	mirror := "konnectivity-server-" + clusterNode
	e.waitPodReady(t, "kube-system", mirror)
	srv := &server{healthPort: initdHealthPort}
	waitFor(t, 2*time.Minute, "the static pod's server with one agent", func() bool { return srv.agentCount() == 1 })
	t.Logf("bootstrap: static pod %s Ready and its agent connected %v after its manifest was written", mirror, time.Since(t0).Round(100*time.Millisecond))
	if fi, err := os.Stat(shippedSocket); err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("the static pod's socket %s: %v %v", shippedSocket, fi, err)
	}

	// Webhooks in pods answer through the static pod's server.
	e.deployWebhook(t)
	stop := webhookCreateLoop(c, clusterNS, "boot")
	time.Sleep(3 * time.Second)
	r := stop()
	t.Logf("bootstrap: %d webhook-gated creates through the static pod's server, %d failed", r.ok, r.failed)
	if r.failed > 0 || r.ok < 10 {
		t.Fatalf("webhook creates through the static pod: %d ok, %d failed: %s", r.ok, r.failed, strings.Join(r.errs, "\n"))
	}
	c.mustDo(t, http.StatusOK, http.MethodDelete, "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/konnectivity-e2e", nil)
	c.mustDo(t, http.StatusOK, http.MethodDelete, "/api/v1/namespaces/"+clusterNS+"/pods?gracePeriodSeconds=1", nil)

	// Teardown as documented: delete the agents (the DaemonSet's file and
	// konnectivity-cluster.yaml), then remove the static pod's file.
	t0 = time.Now()
	e.deleteManifest(t, shippedAgentDaemonSet)
	e.deleteManifest(t, shippedClusterObjects)
	if err := os.Remove(staticPod); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 90*time.Second, "no pod of konnectivity left", func() bool {
		var v any
		gone := !e.get("/api/v1/namespaces/kube-system/pods/"+mirror, &v)
		return gone && len(e.pods(t, "kube-system", "k8s-app%3Dkonnectivity-agent")) == 0
	})
	waitFor(t, 90*time.Second, "every container stopped", func() bool { return len(containerTasks(t)) == 0 })
	t.Logf("bootstrap: torn down in %v", time.Since(t0).Round(100*time.Millisecond))

	// Nothing of konnectivity is left: objects, containers, the socket.
	var left []string
	for _, coll := range []string{
		"/api/v1/pods", "/apis/apps/v1/daemonsets", "/api/v1/serviceaccounts", "/api/v1/configmaps",
		"/apis/rbac.authorization.k8s.io/v1/clusterroles", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
	} {
		var list struct {
			Items []struct {
				Metadata struct{ Name, Namespace string } `json:"metadata"`
			} `json:"items"`
		}
		if !e.get(coll, &list) {
			t.Fatalf("list %s", coll)
		}
		for _, it := range list.Items {
			if strings.Contains(it.Metadata.Name, "konnectivity") {
				left = append(left, coll+": "+it.Metadata.Namespace+"/"+it.Metadata.Name)
			}
		}
	}
	out, err := ctr("containers", "ls")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(out) {
		if strings.Contains(line, "konnectivity") {
			left = append(left, "container: "+strings.TrimSpace(line))
		}
	}
	if _, err := os.Stat(shippedSocket); err == nil {
		left = append(left, "socket "+shippedSocket)
	}
	if len(left) > 0 {
		t.Errorf("left after the documented teardown:\n%s", strings.Join(left, "\n"))
	}
	t.Logf("bootstrap: no object, container or socket of konnectivity left (checked pods, daemonsets, serviceaccounts, configmaps, clusterroles, clusterrolebindings, containerd, %s)", shippedSocket)
	e.kubelet.stop(t)
	t.Logf("bootstrap: done in %v", time.Since(start).Round(100*time.Millisecond))
}
