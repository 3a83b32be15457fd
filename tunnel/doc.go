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
//
// # Words
//
// One word per thing, in code and in docs:
//   - connection: the TLS connection between an agent and a server
//     (agentConn on the server, serverConn on the agent);
//   - link: the HTTP/2 session on a connection (h2link.Conn);
//   - tunnel: one dial, that is one CONNECT stream on a link (or one
//     connect ID on an upstream agent's gRPC stream), from the client's
//     socket to the destination;
//   - pause, handover, resume: a tunnel stopped at a byte-exact point in
//     both directions, passed to the next image of the server's process,
//     and carried on there on a new stream.
//
// # Files
//
// Server: server.go (lifecycle: Serve*, Shutdown, Close), frontend.go (a
// client's CONNECT on the frontend socket), grpc_frontend.go (the gRPC
// front door), admission.go (an agent's connection until it is admitted,
// the limits on it, and register, which puts admitted agents of both kinds
// in the registry), dial.go (picking an agent and opening a tunnel through
// it), upstream_agent.go (upstream's gRPC agents), registry.go, identity.go,
// quiet.go (a drain's close at a quiet moment), handover.go (tunnels paused
// and handed to the next image of the process, and resumed there).
// Agent: agent.go (lifecycle and the tunnel's byte path), agent_conns.go (a
// connection per server), agent_pause.go (its half of a handover: pausing a
// tunnel and holding its destination for the resume), destinations.go (the
// destination policy).
// Shared: handshake.go (the Upgrade request), upload.go, buffers.go,
// conn.go, packets.go and the metrics files.
//
// # Rules
//
// Lifecycles: every goroutine has an owner that ends it: the Server (Close
// waits for all it started) or the Agent (Run returns after its
// connections and tunnels ended). Package-level state is read-only, apart
// from sync.Pools of buffers. The package imports tunnel/internal/h2link (the link),
// tunnel/internal/grpcwire (upstream's Packet wire format) and
// tunnel/promtext (metrics); it never imports package main, auth or certs:
// authentication reaches it as functions in ServerConfig.
//
// # Parked stacks
//
// An idle tunnel costs one goroutine in each process, parked on its
// socket's read: the frontend connection's on the server
// (serveFrontendConn), the stream handler's on the agent ((*Agent).carry).
// The dial and the first write grow these stacks to 8 KiB; the runtime
// halves a parked stack at a collection only while less than a quarter of it
// is in use (counting an 800-byte reserve), so the frames on the parked path
// must stay few and small. Work that needs a large frame (the dial, the
// CONNECT head, a buffered copy) lives in a function that returns before
// the tunnel parks, and deferred work is one closure. TestIdleTunnelStacksShrink
// fails when the parked path grows; the comments that say "see Parked stacks"
// mark the functions that exist for this rule.
package tunnel
