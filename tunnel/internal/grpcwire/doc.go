// Package grpcwire is the wire format of upstream konnectivity's gRPC
// protocol: the Packet message of its client.proto and agent.proto, and
// gRPC's length-prefixed message framing, encoded and decoded by hand (six
// small messages do not justify a protobuf runtime in the binary).
//
// Field numbers and type values are the wire contract with kube-apiserver's
// konnectivity-client and with upstream agents; they never change.
//
// Rules: pure functions over byte slices and an io.Reader, no goroutines, no
// state, no logging, no metrics. Every length a peer announces is checked
// against a limit the caller passes before any memory is spent on it
// (ReadMessage grows its buffer with the bytes that arrive). It
// imports only the standard library.
package grpcwire
