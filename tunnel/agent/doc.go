// Package agent is the konnectivity agent: it keeps a connection to each
// server, serves HTTP/2 on it, and dials the destinations the servers'
// tunnels ask for, within its destination policy.
//
// The package is named for what it is at the call site: agent.New returns
// an *agent.Agent configured by an agent.Config. What the agent and the
// server both speak lives in tunnel/wire; this package never imports the
// server's (tunnel/server), so the compiler holds the seam between the
// two ends.
//
// The words, files, locks and rules of the server, the agent and the wire
// are written once, in the doc of package tunnel (tunnel/doc.go).
package agent
