package e2e

// TestRealCluster (make e2e-cluster) runs the parts an operator deploys as
// they run in a cluster: a real kubelet on containerd and runc with a bridge
// CNI, kube-scheduler and kube-controller-manager beside kube-apiserver and
// etcd (all five built from the k8s.io/kubernetes version e2e/kube pins), the
// agent as the DaemonSet images/ ships with the image images/ociimage
// writes, and webhooks and workloads in pods of the test's own images.
//
// The whole run happens in one private mount, network and PID namespace
// (unshare): tmpfs over /run, /var/lib and /var/log holds what containerd,
// the kubelet and the CNI write, the node's address is a documentation
// address on the namespace's loopback, pods get addresses on a bridge
// inside it, and the kernel kills whatever the run leaves. What the kubelet
// changes outside the namespaces (kernel sysctls, its cgroups) the outer
// test puts back.

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

const (
	clusterNSEnv         = "KONNECTIVITY_CLUSTER_E2E_NS" // set inside the namespaces
	clusterKubeDirEnv    = "KONNECTIVITY_CLUSTER_KUBE_DIR"
	clusterPodBinEnv     = "KONNECTIVITY_CLUSTER_POD_BIN"
	clusterAgentImgEnv   = "KONNECTIVITY_CLUSTER_AGENT_IMAGE"
	clusterCgroupEnv     = "KONNECTIVITY_CLUSTER_CGROUP_ROOT"
	clusterNode          = "node-1"
	clusterNodeIP        = "192.0.2.1"
	clusterPodCIDR       = "198.51.100.0/25"
	clusterNS            = "e2e"
	containerdSock       = "/run/containerd/containerd.sock"
	clusterEtcKubernetes = "/etc/kubernetes"
	clusterPauseImage    = "docker.io/e2e/clusterpod-pause:1"
	clusterWebhookImage  = "docker.io/e2e/clusterpod-webhook:1"
	clusterWorkImage     = "docker.io/e2e/clusterpod-workload:1"
	// clusterTimeout bounds the run inside the namespaces.
	clusterTimeout = 25 * time.Minute
)

// kubeletSysctls are the kernel settings the kubelet sets at start
// (pkg/kubelet/cm, setupKernelTunables): global to the machine, so the
// outer test reads them first and writes back any that changed.
var kubeletSysctls = []string{
	"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
	"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
}

// clusterPrereqs says what this machine lacks for the test, or "".
func clusterPrereqs() string {
	if os.Geteuid() != 0 {
		return fmt.Sprintf("needs root for private namespaces, cgroups and containerd (euid %d)", os.Geteuid())
	}
	var missing []string
	for _, tool := range []string{"unshare", "nsenter", "ip", "go", "containerd", "containerd-shim-runc-v2", "runc", "ctr"} {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		if _, err := os.Stat("/usr/lib/cni/" + p); err != nil {
			missing = append(missing, "/usr/lib/cni/"+p+" (containernetworking-plugins)")
		}
	}
	if len(cgroupMounts()) == 0 {
		missing = append(missing, "a cgroup file system")
	}
	if len(missing) > 0 {
		return "needs " + strings.Join(missing, ", ") + " (.ci/run installs containerd, runc, containernetworking-plugins, iproute2, util-linux)"
	}
	return ""
}

func TestRealCluster(t *testing.T) {
	if os.Getenv(clusterNSEnv) != "" {
		clusterInNamespace(t)
		return
	}
	if why := clusterPrereqs(); why != "" {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s; CI must run this test", why)
		}
		t.Skipf("%s; set CI=true to make this a failure", why)
	}
	t0 := time.Now()
	apiserver, _ := buildKubeBinaries(t)
	kubeDir := filepath.Dir(apiserver)
	buildNodeBinaries(t, kubeDir)
	dir := t.TempDir()
	podBin := clusterPodBinary(t, dir)
	agentImage := os.Getenv("AGENT_IMAGE")
	if agentImage == "" {
		agentImage = filepath.Join(dir, "agent-image.tar")
		cmd := exec.Command("go", "run", "./images/ociimage", "-bin", konnectivityBin, "-tag", "spinifex/konnectivity-agent:e2e",
			"-version", "e2e", "-revision", "e2e", "-out", agentImage)
		cmd.Dir = ".."
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("images/ociimage: %v\n%s", err, b)
		}
	}
	t.Logf("binaries and images ready in %v", time.Since(t0).Round(100*time.Millisecond))

	// What the kubelet changes outside the namespaces.
	sysctls := map[string]string{}
	for _, k := range kubeletSysctls {
		if b, err := os.ReadFile("/proc/sys/" + k); err == nil {
			sysctls[k] = strings.TrimSpace(string(b))
		}
	}
	// The static pod reads host files under /etc/kubernetes, which the
	// inner test covers with a tmpfs: a mount point is needed on the host.
	if _, err := os.Stat(clusterEtcKubernetes); errors.Is(err, fs.ErrNotExist) {
		if err := os.Mkdir(clusterEtcKubernetes, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := os.Remove(clusterEtcKubernetes); err != nil {
				t.Errorf("host: remove the mount point %s made for the test: %v", clusterEtcKubernetes, err)
			}
		})
	}
	cgroupRoot := fmt.Sprintf("/konnectivity-e2e-%d", os.Getpid())
	rootsBefore := cgroupTopLevel()
	t.Cleanup(func() {
		for _, k := range kubeletSysctls {
			want, ok := sysctls[k]
			if !ok {
				continue
			}
			b, _ := os.ReadFile("/proc/sys/" + k)
			if got := strings.TrimSpace(string(b)); got != want {
				if err := os.WriteFile("/proc/sys/"+k, []byte(want), 0o644); err != nil {
					t.Errorf("restore sysctl %s to %s: %v", k, want, err)
				} else {
					t.Logf("host: sysctl %s put back from %s to %s", k, got, want)
				}
			}
		}
		removed, err := removeCgroupTree(cgroupRoot, 30*time.Second)
		if err != nil {
			t.Errorf("host: cgroups under %s: %v", cgroupRoot, err)
		}
		t.Logf("host: %d cgroups under %s removed", removed, cgroupRoot)
		for _, d := range cgroupTopLevel() {
			if !slices.Contains(rootsBefore, d) {
				t.Errorf("host: cgroup %s appeared outside the test's cgroup root %s", d, cgroupRoot)
			}
		}
	})

	makeCgroupRoot(t, cgroupRoot)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	run := "^TestRealCluster$"
	if f := flag.Lookup("test.run"); f != nil && strings.Contains(f.Value.String(), "/") {
		run = "^TestRealCluster$/" + f.Value.String()[strings.Index(f.Value.String(), "/")+1:]
	}
	ctx, cancel := context.WithTimeout(context.Background(), clusterTimeout+time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "unshare", "--net", "--pid", "--mount", "--mount-proc", "--propagation", "private",
		"--fork", "--kill-child",
		self, "-test.run="+run, "-test.count=1", "-test.v", "-test.timeout="+clusterTimeout.String())
	cmd.Env = append(os.Environ(),
		clusterNSEnv+"=1",
		clusterKubeDirEnv+"="+kubeDir,
		clusterPodBinEnv+"="+podBin,
		clusterAgentImgEnv+"="+agentImage,
		clusterCgroupEnv+"="+cgroupRoot,
		"KONNECTIVITY_BIN="+konnectivityBin)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := cmd.Run(); err != nil {
		t.Fatalf("the test in its namespaces failed after %v: %v", time.Since(start).Round(time.Second), err)
	}
	t.Logf("the test in its namespaces passed in %v (%v with builds)", time.Since(start).Round(time.Second), time.Since(t0).Round(time.Second))
}

// buildNodeBinaries builds the kubelet, kube-scheduler and
// kube-controller-manager (tools of e2e/kube) beside kube-apiserver.
func buildNodeBinaries(t *testing.T, dir string) {
	t.Helper()
	for _, name := range []string{"kubelet", "kube-scheduler", "kube-controller-manager"} {
		ctx, cancel := context.WithTimeout(context.Background(), kubeBuildTimeout)
		start := time.Now()
		cmd := exec.CommandContext(ctx, "go", "build", "-o", filepath.Join(dir, name), "k8s.io/kubernetes/cmd/"+name)
		cmd.Dir = kubeModuleDir
		b, err := cmd.CombinedOutput()
		cancel()
		if err != nil {
			t.Fatalf("go build k8s.io/kubernetes/cmd/%s (in e2e/%s): %v\n%s", name, kubeModuleDir, err, b)
		}
		t.Logf("built k8s.io/kubernetes/cmd/%s in %v", name, time.Since(start).Round(100*time.Millisecond))
	}
}

// makeCgroupRoot makes the cgroup root of a kubelet (which wants it to
// exist) in every hierarchy. A cpuset cgroup starts with no CPUs or memory
// nodes, so it gets its parent's.
func makeCgroupRoot(t *testing.T, root string) {
	t.Helper()
	for _, m := range cgroupMounts() {
		p := filepath.Join(m, root)
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatalf("cgroup root %s: %v", p, err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if b, err := os.ReadFile(filepath.Join(filepath.Dir(p), f)); err == nil {
				_ = os.WriteFile(filepath.Join(p, f), b, 0o644)
			}
		}
	}
}

// cgroupMounts are the mount points of the cgroup hierarchies (v1 and v2).
func cgroupMounts() []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS ... - FSTYPE SOURCE SUPEROPTS
		fields := strings.Fields(sc.Text())
		for i, fld := range fields {
			if fld == "-" && i+1 < len(fields) && len(fields) > 4 {
				if fields[i+1] == "cgroup" || fields[i+1] == "cgroup2" {
					out = append(out, fields[4])
				}
				break
			}
		}
	}
	return out
}

// cgroupTopLevel lists the cgroups at the root of every hierarchy.
func cgroupTopLevel() []string {
	var out []string
	for _, m := range cgroupMounts() {
		entries, err := os.ReadDir(m)
		if err != nil {
			continue
		}
		for _, e := range entries {
			if e.IsDir() {
				out = append(out, filepath.Join(m, e.Name()))
			}
		}
	}
	return out
}

// removeCgroupTree removes root (and everything below it) from every
// hierarchy, deepest first, retrying while the kernel still reaps the
// tasks of killed containers.
func removeCgroupTree(root string, bound time.Duration) (int, error) {
	deadline := time.Now().Add(bound)
	removed := 0
	for {
		var left []string
		for _, m := range cgroupMounts() {
			top := filepath.Join(m, root)
			var dirs []string
			_ = filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
				if err == nil && d.IsDir() {
					dirs = append(dirs, p)
				}
				return nil
			})
			for i := len(dirs) - 1; i >= 0; i-- {
				if err := syscall.Rmdir(dirs[i]); err == nil {
					removed++
				} else if !errors.Is(err, syscall.ENOENT) {
					left = append(left, dirs[i]+": "+err.Error())
				}
			}
		}
		if len(left) == 0 {
			return removed, nil
		}
		if time.Now().After(deadline) {
			return removed, fmt.Errorf("%d cgroups left: %s", len(left), strings.Join(left[:min(len(left), 5)], "; "))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// clusterInNamespace is the test proper, inside the private namespaces.
func clusterInNamespace(t *testing.T) {
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"addr", "add", clusterNodeIP + "/32", "dev", "lo"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range ifs {
		if i.Flags&net.FlagLoopback == 0 {
			t.Fatalf("interface %s in the test's network namespace: not a private namespace", i.Name)
		}
	}
	// containerd, the kubelet, the CNI and the init script write under
	// these; in this mount namespace they are the test's own.
	for _, d := range []string{"/run", "/var/lib", "/var/log", clusterEtcKubernetes} {
		if err := syscall.Mount("tmpfs", d, "tmpfs", 0, "mode=0755,size=2g"); err != nil {
			t.Fatalf("mount tmpfs on %s: %v", d, err)
		}
	}
	n := startClusterNode(t)
	defer n.stop(t)
	for _, mode := range []string{"http-connect", "grpc"} {
		if !t.Run(mode, func(t *testing.T) { clusterMode(t, n, mode) }) {
			return
		}
	}
	if !t.Run("bootstrap", func(t *testing.T) { clusterBootstrap(t, n) }) {
		return
	}
	t.Run("two-nodes", func(t *testing.T) { clusterTwoNodes(t, n) })
}

// clusterNodeEnv is what outlives one cluster: containerd with the images
// imported, and the binaries.
type clusterNodeEnv struct {
	kubeDir    string
	podBin     string
	agentImage string // the image name the agent archive holds
	cgroupRoot string
	archives   []string // image archives every node imports
	containerd *proc    // the reaper, containerd its child
}

// startClusterNode starts containerd (under clusterpod's reaper, so that
// its shims are reaped and waited for) and imports the images.
func startClusterNode(t *testing.T) *clusterNodeEnv {
	t.Helper()
	n := &clusterNodeEnv{
		kubeDir:    os.Getenv(clusterKubeDirEnv),
		podBin:     os.Getenv(clusterPodBinEnv),
		cgroupRoot: os.Getenv(clusterCgroupEnv),
	}
	// Images: the agent's as `make agent-image` wrote it, and the test's own.
	bin, err := os.ReadFile(n.podBin)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	n.archives = []string{os.Getenv(clusterAgentImgEnv)}
	for _, img := range []struct {
		name string
		args []string
	}{
		{clusterPauseImage, []string{"/clusterpod", "pause"}},
		{clusterWebhookImage, []string{"/clusterpod", "webhook", "/tls/tls.crt", "/tls/tls.key"}},
		{clusterWorkImage, []string{"/clusterpod", "workload"}},
	} {
		p := filepath.Join(dir, strings.NewReplacer("/", "_", ":", "_").Replace(img.name)+".tar")
		writeClusterImage(t, p, img.name, bin, img.args)
		n.archives = append(n.archives, p)
	}
	n.containerd = n.startRuntime(t, nil, "/run/e2e-node", clusterPodCIDR)
	out, err := ctr("images", "ls", "-q")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(out) {
		if strings.Contains(line, "konnectivity-agent:") {
			n.agentImage = strings.TrimSpace(line)
		}
	}
	if n.agentImage == "" {
		t.Fatalf("no konnectivity-agent image in containerd after the import:\n%s", out)
	}
	return n
}

// startRuntime starts a containerd in the namespaces enter enters (none:
// the test's), with its configuration, the CNI configuration (a bridge
// with host-local addresses from podCIDR) and the IPAM state in dir, and
// imports the images.
func (n *clusterNodeEnv) startRuntime(t *testing.T, enter []string, dir, podCIDR string) *proc {
	t.Helper()
	cniDir, ipamDir := filepath.Join(dir, "net.d"), filepath.Join(dir, "ipam")
	for _, d := range []string{cniDir, ipamDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	config := fmt.Sprintf(`version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = %q
[ttrpc]
  address = "/run/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
`, containerdSock, clusterPauseImage, cniDir)
	cfgFile := filepath.Join(dir, "containerd.toml")
	if err := os.WriteFile(cfgFile, []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	cni := fmt.Sprintf(`{"cniVersion": "0.4.0", "name": "e2e", "plugins": [{
  "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
  "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "dataDir": %q}
}]}`, podCIDR, ipamDir)
	if err := os.WriteFile(filepath.Join(cniDir, "10-e2e.conflist"), []byte(cni), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append(append([]string{}, enter...), n.podBin, "reaper", "containerd", "--config", cfgFile)
	p := startProcBin(t, args[0], "containerd", args[1:]...)
	waitFor(t, time.Minute, "containerd's socket", func() bool {
		if p.exited() {
			t.Fatalf("containerd exited: %v\n%s", p.waitErr, tail(p.out.String(), 4000))
		}
		out, err := ctrIn(enter, "version")
		return err == nil && strings.Contains(out, "Server:")
	})
	for _, a := range n.archives {
		start := time.Now()
		if out, err := ctrIn(enter, "images", "import", a); err != nil {
			t.Fatalf("ctr images import %s: %v\n%s", a, err, out)
		}
		t.Logf("node: imported %s in %v", filepath.Base(a), time.Since(start).Round(10*time.Millisecond))
	}
	return p
}

// ctr runs ctr against the test's containerd, in the k8s.io namespace (the
// CRI's).
func ctr(args ...string) (string, error) { return ctrIn(nil, args...) }

// ctrIn is ctr for the containerd in the namespaces enter enters.
func ctrIn(enter []string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	argv := append(append(append([]string{}, enter...), "ctr", "-a", containerdSock, "-n", "k8s.io"), args...)
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	return string(out), err
}

// containerTasks lists containerd's running tasks: container ID → PID.
func containerTasks(t *testing.T) map[string]int { return containerTasksIn(t, nil) }

// containerTasksIn is containerTasks for the containerd in the namespaces
// enter enters.
func containerTasksIn(t *testing.T, enter []string) map[string]int {
	t.Helper()
	out, err := ctrIn(enter, "tasks", "ls")
	if err != nil {
		t.Fatalf("ctr tasks ls: %v\n%s", err, out)
	}
	m := map[string]int{}
	for i, line := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(line)
		if i == 0 || len(f) < 3 {
			continue
		}
		pid, _ := strconv.Atoi(f[1])
		m[f[0]] = pid
	}
	return m
}

// removeAllContainers kills and deletes every container left in the
// containerd in the namespaces enter enters (after the kubelet stopped), so
// that their shims exit.
func removeAllContainers(t *testing.T, enter []string) int {
	t.Helper()
	tasks := containerTasksIn(t, enter)
	for id := range tasks {
		_, _ = ctrIn(enter, "tasks", "kill", "-s", "SIGKILL", id)
	}
	out, _ := ctrIn(enter, "containers", "ls", "-q")
	ids := strings.Fields(out)
	deadline := time.Now().Add(30 * time.Second)
	for _, id := range ids {
		for {
			out, err := ctrIn(enter, "tasks", "delete", id)
			if err == nil || strings.Contains(out, "not found") || time.Now().After(deadline) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if out, err := ctrIn(enter, "containers", "delete", id); err != nil && !strings.Contains(out, "not found") {
			t.Errorf("ctr containers delete %s: %v %s", id, err, out)
		}
	}
	return len(ids)
}

// stop removes what containers are left and stops containerd; its reaper
// exits once the last shim has.
func (n *clusterNodeEnv) stop(t *testing.T) { stopRuntime(t, n.containerd, nil) }

// stopRuntime removes what containers are left in the containerd of
// reaper (in the namespaces enter enters) and stops it; the reaper exits
// once the last shim has.
func stopRuntime(t *testing.T, reaper *proc, enter []string) {
	t.Helper()
	left := removeAllContainers(t, enter)
	start := time.Now()
	_ = reaper.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-reaper.done:
		t.Logf("node: containerd and its shims exited %v after SIGTERM (%d containers removed first); reaper: %v",
			time.Since(start).Round(10*time.Millisecond), left, reaper.waitErr)
	case <-time.After(30 * time.Second):
		t.Errorf("node: containerd or a shim still running 30s after SIGTERM:\n%s", tail(reaper.out.String(), 3000))
	}
}
