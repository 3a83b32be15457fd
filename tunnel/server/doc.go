// Package server is the konnectivity server: it takes dials from
// kube-apiserver on its front doors (HTTP CONNECT and gRPC), admits agents,
// and carries each dial as a tunnel to an agent that can reach the
// destination.
//
// The package is named for what it is at the call site: server.New
// returns a *server.Server configured by a server.Config, as Tailscale's
// derpserver.New returns a *derpserver.Server beside the wire package it
// speaks. What the agent and the server both speak lives in tunnel/wire;
// this package never imports the agent's (tunnel/agent), so the compiler
// holds the seam between the two ends.
//
// The words, files, locks and rules of the server, the agent and the wire
// are written once, in the doc of package tunnel (tunnel/doc.go).
package server
