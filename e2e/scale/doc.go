// Command scale is konnectivity's scale benchmark: one real server process
// from --bin, N agents (the product's own agent code, run in-process by a few
// simulator processes, each agent with its own TLS connection and link) and M
// idle tunnels held through the front door. For each front door (HTTP CONNECT
// and gRPC, one server run each) it prints the time until N agents are
// connected and the retries that took, server RSS per agent and per idle
// tunnel, the server's idle CPU, and dial p50/p99 with 1 agent, with N and
// with N agents and M tunnels. Each latency figure is taken with its dials
// interleaved with dials through a reference (a second server of the same
// binary and door with one agent, running throughout), and is given as a
// ratio to the reference's: both under the same load of the machine.
// Before each, the simulators and echo processes collect their garbage,
// and the figures of a steady state (RSS, idle CPU, latency) wait
// --after-burst after the fleet connected and after the tunnels opened,
// past the server's memory trim after a burst.
// Figures are reported, not asserted; the exit status counts correctness
// checks only (agents connected, tunnels opened, dials echoed, nothing left
// open).
//
//	cd e2e && go run ./scale --bin ../bin/konnectivity --agents 5000 --tunnels 50000
//
// --other runs the same against another server: upstream's proxy-server
// (a directory holding it), whose agents then speak upstream's agent
// protocol, simulated in-process like ours; or another konnectivity binary.
//
// Descriptors: a process here may hold at most RLIMIT_NOFILE descriptors
// (20,000 on the reference machine). Each agent costs one socket in its
// simulator process and one in the server; each held tunnel costs a
// destination socket in a simulator and one in an echo process, and on the
// HTTP CONNECT door one Unix socket in the server and one in this process.
// Simulators and echo processes are sized to stay under budget, echo
// processes listen on distinct 127.0.0.x addresses so that ephemeral ports
// do not run out, and the HTTP CONNECT door holds as many tunnels as the
// server's limit leaves room for (the gRPC door multiplexes its calls on a
// few connections). kube-apiserver's konnectivity-client opens one gRPC
// connection per tunnel, so the gRPC door's figure per held tunnel leaves
// out that connection's cost; its dials (the latency figures) are made as
// kube-apiserver makes them.
package main
