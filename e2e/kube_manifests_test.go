package e2e

import (
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// shippedManifests are the Kubernetes objects the project ships for a
// cluster: the agent DaemonSet of the node image and the control-plane
// node's static pod with the cluster objects beside it.
var shippedManifests = []string{
	"../images/eks-node/var/lib/rancher/k3s/server/manifests/konnectivity-agent.yaml",
	"../images/control-plane/konnectivity-server.yaml",
	"../images/control-plane/konnectivity-cluster.yaml",
}

// kubeResourcePaths maps a shipped object's apiVersion and kind to its
// collection, %s standing for the namespace where it has one.
var kubeResourcePaths = map[string]string{
	"v1/ServiceAccount": "/api/v1/namespaces/%s/serviceaccounts",
	"v1/ConfigMap":      "/api/v1/namespaces/%s/configmaps",
	"v1/Pod":            "/api/v1/namespaces/%s/pods",
	"apps/v1/DaemonSet": "/apis/apps/v1/namespaces/%s/daemonsets",
	"rbac.authorization.k8s.io/v1/ClusterRole":        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
	"rbac.authorization.k8s.io/v1/ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
}

// kubeDryRunShipped has kube-apiserver check every shipped object as it
// would create it (?dryRun=All: validation, defaulting and admission,
// nothing stored), with unknown or duplicate fields refused
// (fieldValidation=Strict).
func kubeDryRunShipped(t *testing.T, apiserverBin, etcdBin string) {
	dir, err := os.MkdirTemp("", "kme2e")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	c := startKubeCluster(t, apiserverBin, etcdBin, egressConfigFor(t, dir, filepath.Join(dir, "konnectivity-server.socket"), "grpc"), net.ParseIP(kubeNodeIP))
	// What a controller-manager makes: the namespace's default
	// ServiceAccount, which admission gives a pod that names none.
	c.create(t, "/api/v1/namespaces/kube-system/serviceaccounts", obj("ServiceAccount", "v1", "default", "kube-system"))
	n := 0
	for _, file := range shippedManifests {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		// The image tag is filled in when the files are installed.
		data = []byte(strings.ReplaceAll(string(data), "@VERSION@", "v0.0.0-e2e"))
		for _, doc := range niDocuments(t, file, data) {
			j, err := yaml.YAMLToJSON(doc)
			if err != nil {
				t.Fatalf("%s: %v", file, err)
			}
			var head struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
				Metadata   struct {
					Name      string `json:"name"`
					Namespace string `json:"namespace"`
				} `json:"metadata"`
			}
			if err := json.Unmarshal(j, &head); err != nil {
				t.Fatalf("%s: %v", file, err)
			}
			coll, ok := kubeResourcePaths[head.APIVersion+"/"+head.Kind]
			if !ok {
				t.Fatalf("%s: %s %s: no collection known to the test; add it to kubeResourcePaths", file, head.APIVersion, head.Kind)
			}
			if strings.Contains(coll, "%s") {
				if head.Metadata.Namespace == "" {
					t.Fatalf("%s: %s %s has no namespace", file, head.Kind, head.Metadata.Name)
				}
				coll = strings.Replace(coll, "%s", head.Metadata.Namespace, 1)
			}
			code, body, err := c.do(http.MethodPost, coll+"?dryRun=All&fieldValidation=Strict", j)
			if err != nil || code != http.StatusCreated {
				t.Errorf("%s: %s %s: kube-apiserver's dry run answered %d (want 201), err %v: %s", file, head.Kind, head.Metadata.Name, code, err, tail(string(body), 1500))
				continue
			}
			n++
		}
	}
	t.Logf("kube-apiserver accepted %d shipped objects in a dry run", n)
}
