// Command stress moves many bytes through many tunnels at once, through
// one real server and one real agent, on a machine that may be kept busy
// with CPU hogs beside it: the load under which a lost flow-control credit
// shows as tunnels that never finish.
//
// Every tunnel is opened first (CONNECT on the server's Unix socket); then,
// all at the same moment, each moves its bytes in one of three shapes:
//
//   - echo: the client writes --bytes while it reads them back from an
//     echo destination, checking each byte;
//   - download: the destination writes --bytes, the client reads and
//     checks them;
//   - upload: the client writes --bytes, the destination reads and checks
//     them, then answers with one byte.
//
// The destinations stand for pods: they listen in a network namespace of
// their own behind a veth of MTU 1500 (--destinations=pod, the default;
// it needs root), or on loopback (--destinations=loopback), whose 64 KiB
// segments give every destination socket megabytes of kernel buffer.
//
// It prints, per shape and implementation: tunnels completed, errors,
// wall time, bytes per second, peak RSS of both ends (VmHWM) beside the
// bound the receive windows put on what they may hold, and the longest
// time any tunnel went without progress, over the run and once the hogs
// stopped. Figures are reported, not asserted; the exit status is 1 when a
// tunnel did not complete or a byte was wrong.
//
//	cd e2e && go run ./stress --bin ../bin/konnectivity --hogs 2 --hog-for 40s
//	cd e2e && go run ./stress --bin ../bin/konnectivity --other /dir/with/proxy-server-and-proxy-agent
package main
