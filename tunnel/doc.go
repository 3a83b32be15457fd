// Package tunnel carries TCP connections from a kube-apiserver, through a
// konnectivity server, over an agent-initiated TLS connection, to a
// destination the agent can reach.
//
// The agent dials the server and sends one HTTP/1.1 Upgrade request that
// carries its identity. After the server answers 101, the roles flip: the agent
// serves HTTP/2 on the connection it dialled and the server is the HTTP/2
// client. Every tunnelled connection is one HTTP/2 CONNECT stream, so each has
// its own flow-control window and its own end: END_STREAM is a half-close,
// RST_STREAM an abort, GOAWAY a drain and PING a liveness check. No goroutine
// is shared between tunnels on the byte path, so one stalled reader or
// destination cannot stall another tunnel.
package tunnel
