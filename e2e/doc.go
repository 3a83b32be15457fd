// Package e2e holds end-to-end tests for the konnectivity binary.
//
// The tests start the real binary as server and agent processes on loopback
// addresses and unix sockets, and reach test backends through the
// kube-apiserver egress dialer (k8s.io/apiserver/pkg/server/egressselector),
// built the same way kube-apiserver builds it. This module is separate from
// the main module so that k8s.io/apiserver never becomes a dependency of the
// shipped binary.
//
// Run with `go test ./...` from this directory. The binary is built from ../
// unless KONNECTIVITY_BIN names an existing one.
package e2e
