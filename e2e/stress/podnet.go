package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The destinations stand for pods, so they listen where pods listen: in a
// network namespace of their own, behind a veth with the MTU of a pod's
// interface (1500). On loopback (MTU 65536) every destination socket
// starts with a send buffer sized for ten 64 KiB segments, and 2,000 of
// them take more than the kernel's whole TCP memory (tcp_mem) before the
// tunnels carry a byte; the kernel then drops the link's own segments.
// A pod's socket, sized for 1448-byte segments, does not.
//
// The namespace is named nsPrefix plus this process's ID, so that a run
// deletes what a killed run left and never another live run's.
const nsPrefix = "kstress-"

// podMTU is the veth's MTU, a pod interface's.
const podMTU = 1500

// podNetwork is a namespace joined to this one by a veth: the host's end
// and the pod's end each hold one address of a /24 picked at random in
// 198.19.0.0/16 (for benchmarks, RFC 2544).
type podNetwork struct {
	name    string // the namespace
	hostDev string // the veth's end in this namespace
	podIP   string // the address of the veth's end in the namespace
}

// runIP runs ip with args, bounded in time.
func runIP(ctx context.Context, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// deleteLeftovers deletes namespaces this program made in processes that
// are gone; their veths and sockets go with them.
func deleteLeftovers() {
	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		return
	}
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || !strings.HasPrefix(f[0], nsPrefix) {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimPrefix(f[0], nsPrefix))
		if err != nil || pid == os.Getpid() {
			continue
		}
		if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); errors.Is(err, os.ErrNotExist) {
			exec.Command("ip", "netns", "del", f[0]).Run()
		}
	}
}

// newPodNetwork makes the namespace and its veth. It needs root (or
// CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2.
func newPodNetwork(ctx context.Context) (*podNetwork, error) {
	deleteLeftovers()
	var rnd [1]byte
	rand.Read(rnd[:])
	subnet := fmt.Sprintf("198.19.%d.", rnd[0])
	pid := strconv.Itoa(os.Getpid())
	pn := &podNetwork{name: nsPrefix + pid, hostDev: "ksh" + pid, podIP: subnet + "2"}
	podDev := "ksp" + pid
	mtu := strconv.Itoa(podMTU)
	steps := [][]string{
		{"netns", "add", pn.name},
		{"-n", pn.name, "link", "set", "lo", "up"},
		{"link", "add", pn.hostDev, "mtu", mtu, "type", "veth", "peer", "name", podDev, "mtu", mtu, "netns", pn.name},
		{"addr", "add", subnet + "1/24", "dev", pn.hostDev},
		{"-n", pn.name, "addr", "add", pn.podIP + "/24", "dev", podDev},
		{"link", "set", pn.hostDev, "up"},
		{"-n", pn.name, "link", "set", podDev, "up"},
	}
	for _, s := range steps {
		if err := runIP(ctx, s...); err != nil {
			pn.close()
			return nil, fmt.Errorf("pod network (run as root, or --destinations=loopback): %w", err)
		}
	}
	return pn, nil
}

// listen opens a TCP listener inside the namespace. A socket belongs to
// the namespace of the thread that made it, so the listener is made on a
// locked thread moved into the namespace and back; a thread that cannot
// move back is left locked, and the runtime ends it with its goroutine.
func (pn *podNetwork) listen() (net.Listener, error) {
	type answer struct {
		ln  net.Listener
		err error
	}
	ch := make(chan answer, 1)
	go func() { // ends once the listener is made
		runtime.LockOSThread()
		home, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			ch <- answer{err: err}
			return
		}
		defer home.Close()
		ns, err := os.Open("/run/netns/" + pn.name)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- answer{err: err}
			return
		}
		defer ns.Close()
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			ch <- answer{err: fmt.Errorf("enter namespace %s: %w", pn.name, err)}
			return
		}
		ln, lerr := net.Listen("tcp", net.JoinHostPort(pn.podIP, "0"))
		if err := unix.Setns(int(home.Fd()), unix.CLONE_NEWNET); err != nil {
			if ln != nil {
				ln.Close()
			}
			ch <- answer{err: fmt.Errorf("leave namespace %s: %w", pn.name, err)} // the thread stays locked and dies
			return
		}
		runtime.UnlockOSThread()
		ch <- answer{ln, lerr}
	}()
	a := <-ch
	return a.ln, a.err
}

// close deletes the namespace, and with it the veth and every socket in it.
func (pn *podNetwork) close() {
	exec.Command("ip", "netns", "del", pn.name).Run()
}
