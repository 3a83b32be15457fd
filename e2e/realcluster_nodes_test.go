package e2e

// Two nodes in TestRealCluster: a second kubelet and containerd in network
// and mount namespaces of their own (node-2, 192.0.2.2, pods on
// 198.51.100.128/25, its own cgroup root), joined to the first by a veth
// that carries only the nodes' addresses: neither node has a route to the
// other's pods, so a pod is reachable only through the agent on its own
// node. The server runs with --proxy-strategies=node,default.

import (
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

const (
	clusterNode2    = "node-2"
	clusterNode2IP  = "192.0.2.2"
	clusterPodCIDR2 = "198.51.100.128/25"
)

func clusterTwoNodes(t *testing.T, n *clusterNodeEnv) {
	start := time.Now()
	// kube-apiserver on every address of the namespace: node-2's kubelet
	// reaches it at 192.0.2.1.
	e := startCluster(t, n, "two-nodes", "http-connect", "", "--bind-address=0.0.0.0")
	e.setPodCIDR(t, clusterNode, clusterPodCIDR)

	// node-2's namespaces, held by a process of their own.
	holder := startProcBin(t, "unshare", "node-2 namespaces", "--net", "--mount", "--propagation", "private", n.podBin, "pause")
	pid := strconv.Itoa(holder.cmd.Process.Pid)
	waitFor(t, 10*time.Second, "node-2's namespaces", func() bool {
		mine, _ := os.Readlink("/proc/self/ns/net")
		its, err := os.Readlink("/proc/" + pid + "/ns/net")
		return err == nil && its != mine
	})
	enter := []string{"nsenter", "-t", pid, "-n", "-m", "--"}
	run := func(argv ...string) {
		t.Helper()
		if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(argv, " "), err, out)
		}
	}
	in := func(argv ...string) { run(append(append([]string{}, enter...), argv...)...) }
	run("ip", "link", "add", "veth-n2", "type", "veth", "peer", "name", "eth0", "netns", pid)
	run("ip", "link", "set", "veth-n2", "up")
	run("ip", "route", "add", clusterNode2IP+"/32", "dev", "veth-n2")
	in("ip", "link", "set", "lo", "up")
	in("ip", "link", "set", "eth0", "up")
	in("ip", "addr", "add", clusterNode2IP+"/32", "dev", "eth0")
	in("ip", "route", "add", clusterNodeIP+"/32", "dev", "eth0")
	for _, d := range []string{"/run", "/var/lib", "/var/log", clusterEtcKubernetes} {
		in("mount", "-t", "tmpfs", "-o", "mode=0755,size=2g", "tmpfs", d)
	}
	containerd2 := n.startRuntime(t, enter, t.TempDir(), clusterPodCIDR2)
	root2 := n.cgroupRoot + "/" + clusterNode2
	makeCgroupRoot(t, root2)
	u, err := url.Parse(e.c.url)
	if err != nil {
		t.Fatal(err)
	}
	kubelet2 := e.startNodeKubelet(t, clusterKubelet{node: clusterNode2, ip: clusterNode2IP, cgroupRoot: root2,
		apiserver: "https://" + net.JoinHostPort(clusterNodeIP, u.Port()), enter: enter})
	e.waitNodeReady(t, clusterNode2, kubelet2)
	e.setPodCIDR(t, clusterNode2, clusterPodCIDR2)
	t.Logf("two-nodes: %s Ready in its own namespaces and cgroup root %s, %v after start", clusterNode2, root2, time.Since(start).Round(100*time.Millisecond))

	// The server routes by node; the agents are the DaemonSet's, one a node.
	e.startServerAsInitd(t, "KONNECTIVITY_PROXY_STRATEGIES=node,default")
	e.applyAgentDaemonSet(t)
	waitFor(t, 2*time.Minute, "an agent pod Ready on each node", func() bool {
		nodes := map[string]bool{}
		for _, p := range e.pods(t, "kube-system", "k8s-app%3Dkonnectivity-agent") {
			if p.ready() {
				nodes[p.Spec.NodeName] = true
			}
		}
		return len(nodes) == 2
	})
	e.srv.waitAgents(t, 2, 60*time.Second)

	// A workload pod on each node, with the address the node's CNI gave.
	c := e.c
	c.create(t, "/api/v1/namespaces", obj("Namespace", "v1", clusterNS, ""))
	waitFor(t, time.Minute, "ServiceAccount e2e/default", func() bool {
		var v any
		return e.get("/api/v1/namespaces/"+clusterNS+"/serviceaccounts/default", &v)
	})
	nodes := []struct{ node, cidr string }{{clusterNode, clusterPodCIDR}, {clusterNode2, clusterPodCIDR2}}
	pods := map[string]clusterPod{}
	for _, nd := range nodes {
		name := "work-" + nd.node
		p := obj("Pod", "v1", name, clusterNS)
		p["spec"] = map[string]any{
			"nodeName":                      nd.node,
			"automountServiceAccountToken":  false,
			"terminationGracePeriodSeconds": 1,
			"containers":                    []any{map[string]any{"name": "app", "image": clusterWorkImage, "imagePullPolicy": "Never"}},
		}
		c.create(t, "/api/v1/namespaces/"+clusterNS+"/pods", p)
	}
	for _, nd := range nodes {
		p := e.waitPodReady(t, clusterNS, "work-"+nd.node)
		_, cidr, _ := net.ParseCIDR(nd.cidr)
		if ip := net.ParseIP(p.Status.PodIP); ip == nil || !cidr.Contains(ip) {
			t.Fatalf("pod %s on %s has address %q, not from its node's pod range %s", p.Metadata.Name, nd.node, p.Status.PodIP, nd.cidr)
		}
		pods[nd.node] = p
	}
	// This namespace (node-1's, where kube-apiserver and the server run)
	// has no route to node-2's pods.
	if conn, err := net.DialTimeout("tcp", net.JoinHostPort(pods[clusterNode2].Status.PodIP, "8081"), 2*time.Second); err == nil {
		conn.Close()
		t.Fatalf("node-1's namespace reaches node-2's pod %s directly: the routing check proves nothing", pods[clusterNode2].Status.PodIP)
	}

	// pods/proxy to each pod's address, logs and exec through its
	// node's kubelet: all through the agent on the pod's node.
	const rounds = 20
	for _, nd := range nodes {
		p := pods[nd.node]
		t0 := time.Now()
		for i := range rounds {
			code, body, err := c.do(http.MethodGet, "/api/v1/namespaces/"+clusterNS+"/pods/"+p.Metadata.Name+":8081/proxy/", nil)
			if err != nil || code != http.StatusOK || string(body) != "pod "+p.Metadata.Name+"\n" {
				t.Fatalf("pods/proxy to %s (%s on %s) #%d: %d %v %q", p.Metadata.Name, p.Status.PodIP, nd.node, i, code, err, tail(string(body), 300))
			}
		}
		proxied := time.Since(t0)
		code, body, err := c.do(http.MethodGet, "/api/v1/namespaces/"+clusterNS+"/pods/"+p.Metadata.Name+"/log?tailLines=1", nil)
		if err != nil || code != http.StatusOK || !strings.HasPrefix(string(body), "line ") {
			t.Fatalf("logs of %s: %d %v %q", p.Metadata.Name, code, err, tail(string(body), 300))
		}
		rtt, err := interactiveEcho(c, c.url+"/api/v1/namespaces/"+clusterNS+"/pods/"+p.Metadata.Name+"/exec?container=app&command=%2Fclusterpod&command=cat&stdin=true&stdout=true", 5, 16<<10, true)
		if err != nil {
			t.Fatalf("exec in %s: %v", p.Metadata.Name, err)
		}
		t.Logf("two-nodes: pod %s on %s (address %s from %s): %d pods/proxy GETs to its address in %v, logs and exec (p50 %v) through its kubelet",
			p.Metadata.Name, nd.node, p.Status.PodIP, nd.cidr, rounds, proxied.Round(time.Millisecond), rtt.Round(100*time.Microsecond))
	}

	// Teardown: pods and agents, then both kubelets and node-2's runtime.
	c.mustDo(t, http.StatusOK, http.MethodDelete, "/api/v1/namespaces/"+clusterNS+"/pods?gracePeriodSeconds=1", nil)
	e.deleteAgents(t)
	waitFor(t, 90*time.Second, "every container stopped on both nodes", func() bool {
		return len(containerTasks(t)) == 0 && len(containerTasksIn(t, enter)) == 0
	})
	kubelet2.stop(t)
	e.kubelet.stop(t)
	e.srv.proc.stop(t)
	stopRuntime(t, containerd2, enter)
	holder.stop(t)
	t.Logf("two-nodes: done in %v", time.Since(start).Round(100*time.Millisecond))
}

// setPodCIDR gives node its pod range, as the node IPAM controller would
// (each node's CNI hands out addresses from a fixed range).
func (e *clusterEnv) setPodCIDR(t *testing.T, node, cidr string) {
	t.Helper()
	e.patch(t, "/api/v1/nodes/"+node, "application/merge-patch+json", fmt.Sprintf(`{"spec":{"podCIDR":%q,"podCIDRs":[%q]}}`, cidr, cidr))
}
