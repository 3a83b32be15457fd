// Command bench is konnectivity's benchmark. It starts a real server and
// agent from --bin, puts an in-process loopback destination behind them and
// measures latency, throughput, CPU, concurrency, memory and head-of-line
// blocking, each beside the same work done over direct loopback TCP. Targets
// are reported, not asserted; the exit status counts correctness checks only
// (bytes intact, no errors).
//
//	cd e2e && go run ./bench --bin ../bin/konnectivity
package main
