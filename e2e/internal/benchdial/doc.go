// Package benchdial opens tunnels through the server's front doors as
// kube-apiserver does, for the benchmark programs (e2e/bench, e2e/scale):
// HTTP CONNECT on the Unix socket, one socket per tunnel, and gRPC through
// upstream's konnectivity-client, one single-use connection per tunnel.
package benchdial
