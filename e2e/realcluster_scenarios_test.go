package e2e

// The scenarios of TestRealCluster that run on each cluster (both egress
// modes): the node-image story and rollouts under load.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/tools/remotecommand"
)

// nodeImageStory: through kube-apiserver's egress, the server on the host
// and the agent in its DaemonSet pod carry webhook calls to a pod (admitted
// and denied), a followed log, an interactive exec, an attach and a
// port-forward into real containers, each byte checked.
func (e *clusterEnv) nodeImageStory(t *testing.T) {
	c := e.c
	// Webhook-gated creates: all pass; a name the webhook denies is
	// refused with the webhook's own message.
	const creates, denials = 40, 5
	var lat []time.Duration
	for i := range creates {
		t0 := time.Now()
		c.create(t, "/api/v1/namespaces/"+clusterNS+"/configmaps", obj("ConfigMap", "v1", fmt.Sprintf("ok-%d", i), clusterNS))
		lat = append(lat, time.Since(t0))
	}
	for i := range denials {
		name := fmt.Sprintf("deny-%d", i)
		code, body, err := c.do(http.MethodPost, "/api/v1/namespaces/"+clusterNS+"/configmaps", obj("ConfigMap", "v1", name, clusterNS))
		if err != nil || code == http.StatusCreated || !strings.Contains(string(body), "e2e webhook pod denies "+name) {
			t.Fatalf("create %s: status %d, err %v, want the webhook pod's denial: %s", name, code, err, tail(string(body), 500))
		}
	}
	slices.Sort(lat)
	t.Logf("%s: %d webhook-gated creates admitted by the webhook pod (p50 %v, max %v), %d denied with its message",
		e.mode, creates, lat[len(lat)/2].Round(100*time.Microsecond), lat[len(lat)-1].Round(100*time.Microsecond), denials)

	// kubectl logs -f: consecutive numbered lines from the container.
	t0 := time.Now()
	n, first := e.followWorkloadLog(t, 30)
	t.Logf("%s: logs -f: %d consecutive lines from \"line %d\" in %v", e.mode, n, first, time.Since(t0).Round(10*time.Millisecond))

	// exec with stdin: an interactive round trip, then a block.
	podURL := c.url + "/api/v1/namespaces/" + clusterNS + "/pods/workload"
	rtt, err := interactiveEcho(c, podURL+"/exec?container=app&command=%2Fclusterpod&command=cat&stdin=true&stdout=true", 20, 128<<10, true)
	if err != nil {
		t.Fatalf("exec: %v", err)
	}
	t.Logf("%s: exec /clusterpod cat: 20 interactive round trips (p50 %v) and 128 KiB echoed byte-exact", e.mode, rtt.Round(100*time.Microsecond))
	// attach to the running shell container (its process is cat).
	rtt, err = interactiveEcho(c, podURL+"/attach?container=shell&stdin=true&stdout=true", 20, 64<<10, false)
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	t.Logf("%s: attach: 20 interactive round trips (p50 %v) and 64 KiB echoed byte-exact", e.mode, rtt.Round(100*time.Microsecond))
	// port-forward to the workload's echo port.
	t0 = time.Now()
	if err := portForwardEcho(c.restConfig(), podURL+"/portforward", 8080, 256<<10); err != nil {
		t.Fatalf("port-forward: %v", err)
	}
	t.Logf("%s: port-forward: 256 KiB echoed byte-exact through the pod's port 8080 in %v", e.mode, time.Since(t0).Round(10*time.Millisecond))
}

// followWorkloadLog follows the workload's log (GET pods/log?follow=true)
// until want lines came, each the successor of the one before.
func (e *clusterEnv) followWorkloadLog(t *testing.T, want int) (lines, first int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.c.url+"/api/v1/namespaces/"+clusterNS+"/pods/workload/log?container=app&follow=true&tailLines=1", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := e.c.admin.Do(req)
	if err != nil {
		t.Fatalf("logs -f: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		t.Fatalf("logs -f: status %d: %s", resp.StatusCode, b)
	}
	sc := bufio.NewScanner(resp.Body)
	next := -1
	for sc.Scan() {
		var n int
		if _, err := fmt.Sscanf(sc.Text(), "line %d", &n); err != nil {
			t.Fatalf("logs -f: line %q", sc.Text())
		}
		if next >= 0 && n != next {
			t.Fatalf("logs -f: %q after line %d", sc.Text(), next-1)
		}
		if next < 0 {
			first = n
		}
		next = n + 1
		if lines++; lines == want {
			return lines, first
		}
	}
	t.Fatalf("logs -f: stream ended after %d lines: %v", lines, sc.Err())
	return 0, 0
}

// interactiveEcho opens an exec or attach stream at u as kubectl 1.37 does
// (client-go's WebSocket executor), whose process copies stdin to stdout:
// rounds lines are each written once the previous came back (the median
// round trip is returned), then block bytes must come back unchanged. With
// closeStdin the stream must end when stdin closes (exec: cat exits);
// otherwise it is cancelled (attach: the container goes on).
func interactiveEcho(c *kubeCluster, u string, rounds, block int, closeStdin bool) (time.Duration, error) {
	ex, err := remotecommand.NewWebSocketExecutor(c.restConfig(), http.MethodGet, u)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	done := make(chan error, 1)
	go func() {
		err := ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdin: inR, Stdout: outW})
		outW.CloseWithError(fmt.Errorf("stream ended: %v", err))
		done <- err
	}()
	br := bufio.NewReader(outR)
	var rtts []time.Duration
	for i := range rounds {
		line := fmt.Sprintf("round %d\n", i)
		t0 := time.Now()
		if _, err := io.WriteString(inW, line); err != nil {
			return 0, fmt.Errorf("write round %d: %w", i, err)
		}
		got, err := br.ReadString('\n')
		if err != nil {
			return 0, fmt.Errorf("read round %d: %w", i, err)
		}
		if got != line {
			return 0, fmt.Errorf("round %d: got %q, want %q", i, got, line)
		}
		rtts = append(rtts, time.Since(t0))
	}
	want := pattern(block)
	werr := make(chan error, 1)
	go func() {
		_, err := inW.Write(want)
		werr <- err
	}()
	got := make([]byte, len(want))
	if _, err := io.ReadFull(br, got); err != nil {
		return 0, fmt.Errorf("read block: %w", err)
	}
	if err := <-werr; err != nil {
		return 0, fmt.Errorf("write block: %w", err)
	}
	if !bytes.Equal(got, want) {
		return 0, fmt.Errorf("block: %d bytes back, sha %s, want sha %s", len(got), sha(got), sha(want))
	}
	if closeStdin {
		inW.Close()
		select {
		case err := <-done:
			if err != nil {
				return 0, fmt.Errorf("stream after stdin closed: %w", err)
			}
		case <-time.After(20 * time.Second):
			return 0, fmt.Errorf("stream still open 20s after stdin closed")
		}
	} else {
		cancel()
		<-done
	}
	slices.Sort(rtts)
	return rtts[len(rtts)/2], nil
}

// rolloutsUnderLoad: a loop of webhook-gated creates through the pod goes
// on while the agent DaemonSet is rolled (kubectl rollout restart), the
// server re-executes in place (SIGHUP, as the init script's reload does)
// and the agent re-executes in place in its container (SIGHUP).
func (e *clusterEnv) rolloutsUnderLoad(t *testing.T) {
	c := e.c
	// kubectl rollout restart daemonset/konnectivity-agent. With one node
	// and maxUnavailable: 1 the old pod goes before its successor starts:
	// the longest stretch with no agent connected is measured.
	old := e.waitAgentPod(t, "")
	stop := webhookCreateLoop(c, clusterNS, "roll-"+strings.ReplaceAll(e.mode, "-", ""))
	gapDone, gapOut := make(chan struct{}), make(chan time.Duration, 1)
	go func() {
		var longest time.Duration
		var since time.Time
		for {
			select {
			case <-gapDone:
				gapOut <- longest
				return
			case <-time.After(50 * time.Millisecond):
			}
			if e.srv.agentCount() == 0 {
				if since.IsZero() {
					since = time.Now()
				}
				longest = max(longest, time.Since(since))
			} else {
				since = time.Time{}
			}
		}
	}()
	time.Sleep(time.Second)
	t0 := time.Now()
	patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":%q}}}}}`, time.Now().UTC().Format(time.RFC3339))
	e.patch(t, "/apis/apps/v1/namespaces/kube-system/daemonsets/konnectivity-agent", "application/strategic-merge-patch+json", patch)
	fresh := e.waitAgentPod(t, old.Metadata.UID)
	waitFor(t, 60*time.Second, "the old agent pod gone", func() bool {
		for _, p := range e.pods(t, "kube-system", "k8s-app%3Dkonnectivity-agent") {
			if p.Metadata.UID == old.Metadata.UID {
				return false
			}
		}
		return true
	})
	e.srv.waitAgents(t, 1, 60*time.Second)
	rolled := time.Since(t0)
	time.Sleep(time.Second)
	r := stop()
	close(gapDone)
	gap := <-gapOut
	t.Logf("%s: rollout restart of the agent DaemonSet (%s → %s) in %v, at most %v with no agent connected: %d webhook-gated creates, %d lost (%d of them finding no agent within --agent-wait)",
		e.mode, old.Metadata.Name, fresh.Metadata.Name, rolled.Round(100*time.Millisecond), gap.Round(10*time.Millisecond), r.ok, r.failed, r.noAgent)
	if r.ok < 10 {
		t.Fatalf("rollout restart: only %d creates passed, %d failed: %s", r.ok, r.failed, strings.Join(r.errs, "\n"))
	}
	// A call that finds no agent for --agent-wait (5s) is lost to the
	// window a one-node rollout has with no agent, not to the tunnels:
	// reported, and asserted only through the other losses.
	lost := r.failed - r.noAgent
	switch {
	case r.failed > 0 && e.mode == "grpc":
		t.Logf("%s: creates lost across the rollout: %s", e.mode, strings.Join(r.errs, "\n"))
	case lost > 1:
		t.Errorf("rollout restart on %s: %d creates lost with an agent connected, more than the one that may race the quiet close: %s", e.mode, lost, strings.Join(r.errs, "\n"))
	case r.failed > 0:
		t.Logf("%s: creates lost across the rollout (at most one racing the quiet close of its connection; the rest found no agent): %s", e.mode, strings.Join(r.errs, "\n"))
	}

	// The server re-executes in place (SIGHUP) twice.
	stop = webhookCreateLoop(c, clusterNS, "shup-"+strings.ReplaceAll(e.mode, "-", ""))
	pid := e.srv.proc.cmd.Process.Pid
	for i := range 2 {
		time.Sleep(time.Second)
		execs := strings.Count(e.srv.proc.out.String(), "re-executing in place")
		e.srv.proc.signal(t, syscall.SIGHUP)
		waitFor(t, 30*time.Second, fmt.Sprintf("server re-exec after SIGHUP #%d", i+1), func() bool {
			return strings.Count(e.srv.proc.out.String(), "re-executing in place") > execs
		})
		e.srv.waitAgents(t, 1, 30*time.Second)
	}
	time.Sleep(time.Second)
	r = stop()
	if e.srv.proc.exited() || e.srv.proc.cmd.Process.Pid != pid {
		t.Fatalf("server process changed across SIGHUP")
	}
	t.Logf("%s: server SIGHUP ×2 (same PID %d): %d webhook-gated creates, %d lost", e.mode, pid, r.ok, r.failed)
	if r.failed > 0 || r.ok < 10 {
		t.Errorf("server SIGHUP: %d ok, %d lost: %s", r.ok, r.failed, strings.Join(r.errs, "\n"))
	}

	// The agent re-executes in place in its container (SIGHUP to its
	// process), twice: same container, no restart.
	p := e.waitAgentPod(t, "")
	if len(p.Status.ContainerStatuses) != 1 {
		t.Fatalf("agent pod has %d container statuses", len(p.Status.ContainerStatuses))
	}
	cs := p.Status.ContainerStatuses[0]
	apid := agentPID(t, cs.ContainerID)
	logFile := filepath.Join("/var/log/pods", "kube-system_"+p.Metadata.Name+"_"+p.Metadata.UID, "konnectivity-agent", fmt.Sprintf("%d.log", cs.RestartCount))
	agentLog := func() string {
		b, _ := os.ReadFile(logFile)
		return string(b)
	}
	if agentLog() == "" {
		t.Fatalf("agent container log %s empty or missing", logFile)
	}
	stop = webhookCreateLoop(c, clusterNS, "ahup-"+strings.ReplaceAll(e.mode, "-", ""))
	for i := range 2 {
		time.Sleep(time.Second)
		execs := strings.Count(agentLog(), "re-executing in place")
		signalPID(t, apid, syscall.SIGHUP)
		waitFor(t, 30*time.Second, fmt.Sprintf("agent re-exec after SIGHUP #%d", i+1), func() bool {
			return strings.Count(agentLog(), "re-executing in place") > execs
		})
		e.srv.waitAgents(t, 1, 30*time.Second)
	}
	time.Sleep(time.Second)
	r = stop()
	var after clusterPod
	if !e.get("/api/v1/namespaces/kube-system/pods/"+p.Metadata.Name, &after) || len(after.Status.ContainerStatuses) != 1 ||
		after.Status.ContainerStatuses[0].RestartCount != cs.RestartCount || agentPID(t, cs.ContainerID) != apid {
		t.Fatalf("the agent's container restarted or changed across its SIGHUPs")
	}
	t.Logf("%s: agent SIGHUP ×2 in its container (same PID %d, restarts %d): %d webhook-gated creates, %d lost",
		e.mode, apid, cs.RestartCount, r.ok, r.failed)
	if r.failed > 0 || r.ok < 10 {
		t.Errorf("agent SIGHUP in its pod: %d ok, %d lost: %s", r.ok, r.failed, strings.Join(r.errs, "\n"))
	}
}

// patch sends a PATCH of type ct as the admin and expects 200.
func (e *clusterEnv) patch(t *testing.T, path, ct, body string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPatch, e.c.url+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", ct)
	resp, err := e.c.admin.Do(req)
	if err != nil {
		t.Fatalf("PATCH %s: %v", path, err)
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("PATCH %s: %d %s", path, resp.StatusCode, tail(string(b), 1000))
	}
}
