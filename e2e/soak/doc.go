// Command soak runs a konnectivity server and two agents under a bounded,
// mixed workload for a fixed time while it restarts the server (SIGHUP) and
// churns one agent (SIGTERM and SIGKILL in turn), and fails on any lost
// byte or on a leak.
//
//	go run ./soak --bin ../bin/konnectivity --duration 10m
//
// Workload: short dials (CONNECT, a 32-byte echo, close; latency measured
// from the CONNECT to the echo) and long streams (N random bytes up and M
// down at once; the destination answers with the SHA-256 of what it
// received and of what it sent, so a lost, duplicated or corrupted byte in
// either direction is caught). Every interval prints successes, errors,
// p50/p99 dial latency, and RSS, goroutines and open files of each process.
//
// Exit status: 0 if no byte was lost, no error happened outside the window
// of an agent SIGKILL, and goroutines, open files and RSS are back near
// their baselines at the end; 1 otherwise.
package main
