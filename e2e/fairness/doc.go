// Command fairness measures whether an interactive tunnel stays fast
// beside bulk ones on a slow or long link, for this project and, with
// --other, for another build in the same run (upstream's proxy-server and
// proxy-agent, or another konnectivity binary).
//
// Two network namespaces it makes itself: the control plane (the server;
// its Unix socket is a path, so the benchmark's own client reaches it from
// outside) and the node (the agent, a source of zero bytes and an echo
// backend on the node's loopback), joined by a veth whose two ends are
// shaped with tc tbf (a rate and a queue bound; this kernel has no netem).
// A long link is a delaying relay of the benchmark's own instead: an HTTP
// CONNECT proxy in the node namespace that the agent reaches through
// HTTPS_PROXY, which holds every byte for a fixed time each way and limits
// nothing else.
//
// For each row a probe tunnel sends a 64-byte echo every 10 ms, without
// waiting for the ones on their way, and times each round trip, alone and
// then beside N bulk tunnels that download from the source at
// full speed; the table gives the bulk tunnels' rate and the probe's p50
// and p99 beside them, and each row with a target says whether this
// project met it (a p99 missed while the probe alone misses it too is
// marked a noisy run: the machine's, not the build's). Figures are
// printed, never asserted; the exit
// status counts correctness failures (a process that would not start, a
// probe whose echo came back wrong or not at all).
//
// It needs root (namespaces, tc). Namespaces are named kfair-*; they take
// their veth, qdiscs and sockets with them when deleted, which the run
// does however it ends, and a later run deletes any a killed run left.
// Processes are killed with the benchmark (Pdeathsig).
//
//	cd e2e && go run ./fairness --bin ../bin/konnectivity --other /work/upstream
package main
