package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// nsPrefix names the namespaces this benchmark makes; a run deletes any
// that a killed run left behind before it makes its own.
const nsPrefix = "kfair-"

// The veth's addresses (198.18.0.0/15 is for benchmarks, RFC 2544).
const (
	cpIP    = "198.18.0.1"
	nodeIP  = "198.18.0.2"
	cpDev   = "kfcp"
	nodeDev = "kfnode"
)

// testbed is the two namespaces and the veth between them.
type testbed struct {
	cp, node string // namespace names
}

// ip runs the ip or tc command with args, bounded in time.
func ip(ctx context.Context, cmd string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, cmd, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", cmd, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// deleteLeftovers deletes namespaces named nsPrefix* that a killed run
// left; their veths, qdiscs and sockets go with them.
func deleteLeftovers() {
	out, err := exec.Command("ip", "netns", "list").Output()
	if err != nil {
		return
	}
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) > 0 && strings.HasPrefix(f[0], nsPrefix) {
			exec.Command("ip", "netns", "del", f[0]).Run()
		}
	}
}

// newTestbed makes the control plane and node namespaces joined by a veth.
func newTestbed(ctx context.Context) (*testbed, error) {
	deleteLeftovers()
	var rnd [3]byte
	rand.Read(rnd[:])
	id := hex.EncodeToString(rnd[:])
	tb := &testbed{cp: nsPrefix + "cp-" + id, node: nsPrefix + "node-" + id}
	steps := [][]string{
		{"ip", "netns", "add", tb.cp},
		{"ip", "netns", "add", tb.node},
		{"ip", "-n", tb.cp, "link", "set", "lo", "up"},
		{"ip", "-n", tb.node, "link", "set", "lo", "up"},
		{"ip", "-n", tb.cp, "link", "add", cpDev, "type", "veth", "peer", "name", nodeDev, "netns", tb.node},
		{"ip", "-n", tb.cp, "addr", "add", cpIP + "/24", "dev", cpDev},
		{"ip", "-n", tb.node, "addr", "add", nodeIP + "/24", "dev", nodeDev},
		{"ip", "-n", tb.cp, "link", "set", cpDev, "up"},
		{"ip", "-n", tb.node, "link", "set", nodeDev, "up"},
	}
	for _, s := range steps {
		if err := ip(ctx, s[0], s[1:]...); err != nil {
			tb.close()
			return nil, err
		}
	}
	return tb, nil
}

// shape puts a tbf of rate with a queue bound of latency on both ends of
// the veth; an empty rate takes any shaping off.
func (tb *testbed) shape(ctx context.Context, rate string, latency time.Duration) error {
	for _, end := range [][2]string{{tb.cp, cpDev}, {tb.node, nodeDev}} {
		if rate == "" {
			exec.CommandContext(ctx, "tc", "-n", end[0], "qdisc", "del", "dev", end[1], "root").Run() // none there is fine
			continue
		}
		err := ip(ctx, "tc", "-n", end[0], "qdisc", "replace", "dev", end[1], "root", "tbf",
			"rate", rate, "burst", burstFor(rate), "latency", fmt.Sprintf("%dms", latency.Milliseconds()))
		if err != nil {
			return err
		}
	}
	return nil
}

// burstFor is the tbf bucket: a millisecond of the rate, at least 16 KiB.
func burstFor(rate string) string {
	bits := map[string]int64{"1gbit": 1e9, "100mbit": 100e6, "20mbit": 20e6}[rate]
	return fmt.Sprintf("%d", max(bits/8/1000, 16<<10))
}

// close deletes both namespaces, and with them the veth and its qdiscs.
func (tb *testbed) close() {
	exec.Command("ip", "netns", "del", tb.cp).Run()
	exec.Command("ip", "netns", "del", tb.node).Run()
}
