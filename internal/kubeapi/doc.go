// Package kubeapi is what konnectivity's clients of the Kubernetes REST
// API (auth, internal/lease, internal/nodemap, calling through
// internal/kubeclient) share about the API's answers: how an answer other
// than success becomes an *Error carrying the Status code, reason and
// message, how one object read from an answer is bounded in size, what a
// Node object says (DecodeNode, read the same way wherever a Node is
// read), and how calls are spaced (Pace, Sleep, Jitter) so that a fleet of
// clients never calls the apiserver in a tight loop or in step.
//
// Rules: a client never trusts the size of an answer, so an error body is
// read up to MaxErrorBody and an object through a BoundedReader; an *Error
// is the only error type that means "the apiserver answered", so callers
// tell API refusals from network failures with errors.As. The package does
// no I/O of its own (connections are internal/kubeclient's), owns no
// goroutine, keeps no package-level mutable state, and imports only the
// standard library.
package kubeapi
