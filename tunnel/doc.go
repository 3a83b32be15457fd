// Package tunnel is the map of the tunnel's three packages (server,
// agent and wire; see Packages): together they carry TCP connections from a kube-apiserver, through a
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
//     (agentConn on the server, connToServer on the agent);
//   - link: the HTTP/2 session on a connection (h2link.Conn);
//   - opener: what opens an agent's tunnels on the server (tunnelOpener):
//     our agent's link (linkOpener) or an upstream agent's Packet stream
//     (upstreamAgent); agentConn holds one and never asks which;
//   - tunnel: one dial, that is one CONNECT stream on a link (or one
//     connect ID on an upstream agent's gRPC stream), from the client's
//     socket to the destination; on the server, the type tunnel; on the
//     agent, a count (Stats.Tunnels) from the stream's take to its end;
//   - front door: where clients dial, HTTP CONNECT or gRPC; a tunnel's
//     side of it is its front;
//   - handover: a restart's move of open tunnels to the next image of
//     the server's process, each stopped at a byte-exact point in both
//     directions and resumed there on a new stream; an agent's restart
//     in place moves its tunnels the same way to the agent's next image,
//     the client's side staying in the server;
//   - handed (over, on, in): what a restart moves to the next image of
//     the process, a socket or a paused tunnel (daemon.Hand,
//     daemon.Handed, tunnel.handed), seen from either image; anything
//     else is given (the write lock's turns, a pacer's moments, a DATA
//     payload to its reader);
//   - quiet close: a drain's close of a tunnel its client is not using
//     (quiet.go), which the client takes for a server closing an idle
//     keep-alive connection and dials again; a cut is a tunnel's end at a
//     drain's deadline, whatever it carries then;
//   - carry: move a tunnel's bytes (or a line, a header) from one side
//     to the other: (*Agent).carry, carryGRPC, carryDirect; a tunnel that
//     goes on after a restart is resumed, never carried on;
//   - carrier: the goroutine that carries one direction of a gRPC front
//     door call while bytes move, started by the source when it has
//     bytes and gone once it is quiet (tunnel.go);
//   - asked: a front door connection's dial is asked for once its
//     CONNECT head is read (or its gRPC DIAL_REQ); only then does a
//     shutdown wait for it (pendingDial), and an unasked connection moves
//     to the next image as it is;
//   - held: a paused tunnel that no goroutine serves, in the table until
//     its agent logs in again (or, unasked, until the handover that took
//     it passes it on): a state of the tunnel on the server, like every
//     other (`held` in konnectivity status). Nothing else is held: a lock
//     is taken, and a function that needs it says the caller holds it; a
//     gRPC call whose handler returned outlives it (h2link.Outlive); an
//     agent redials each fixed address (the agent's status key "held" and
//     the header Konnectivity-Held-Servers, which peers and tools read,
//     count its server connections);
//   - kept: a paused tunnel's destination connection on the agent, open
//     under the server's resume token until a resume takes it or its time
//     is up, or passed to the agent's next image (Agent.KeptForNextImage);
//     what else stays is saved, stored or reserved;
//   - leave: go away: a server or an agent shutting down or restarting
//     (Server.leaving), a tunnel out of the table (Server.leave), a client
//     that hung up, a frame out of the process; what is left of a time or
//     a budget is what remains of it (the drain's log key left). What is
//     not closed or changed stays; it is never left;
//   - credit stall: a link's tunnels waiting for flow-control credit that
//     does not come, or credit a link owes its peer and does not return
//     (h2link's stall.go); not a stalled link (a peer that does not read:
//     h2link.ErrStalled) nor a stalled tunnel (a client that does not read).
//
// # Packages
//
// The tunnel is three packages, so that the compiler holds the seam
// between the two ends: tunnel/server (package server: server.Server,
// server.Config, server.New), tunnel/agent (package agent: agent.Agent,
// agent.Config, agent.New) and tunnel/wire (package wire), what both
// speak. The server and the agent never import each other; both import
// wire, tunnel/internal/h2link (the link) and tunnel/internal/grpcwire
// (upstream's Packet wire format). This package holds no code: it is
// the map of the three. tunnel/internal/tunneltest is the tests' harness:
// it starts both ends through the small interfaces it declares, so the
// tests inside either package can use it without an import cycle.
//
// # Files
//
// Server (tunnel/server): server.go (lifecycle: Serve*, Shutdown, Close),
// tunnel.go (the tunnel type, its states and the table Server.tunnels),
// frontend.go (the HTTP CONNECT front door), grpc_frontend.go (the gRPC
// front door), mode_mismatch.go (each door's answer to a client of the
// other protocol), upload.go (a tunnel's upload), admission.go (an agent's
// connection until it is admitted, the limits on it, and register, which
// puts admitted agents of both kinds in the registry), replaced.go (logins
// that replace a connection of their agent ID), dial.go (picking an
// agent and opening a tunnel through it), upstream_agent.go (upstream's
// gRPC agents), registry.go and registry_index.go (the agents by what a
// strategy asks for), identity.go, quiet.go (the quiet close, for a
// server's drain or one agent's), hangup.go (clients that left),
// handover.go and handover_*.go, handed.go (the server's half of a
// restart's move: the handover type, its hooks, pause, held and resume
// parts, what crosses execve), handover_agent.go
// (the server's half of an agent's restart in place), server_metrics.go,
// status.go.
// Agent (tunnel/agent): agent.go (lifecycle and the tunnel's byte path),
// agent_conns.go (a connection per server), destinations.go (the
// destination policy), agent_metrics.go (its metrics and status), and the
// agent's half of that move in agent_pause.go and agent_restart.go.
// Wire (tunnel/wire), what both sides speak: handshake.go (the Upgrade
// request, the control line and the move's requests), connect.go (a
// CONNECT head, StatusError), identifiers.go, packets.go (upstream's
// Packet counts, stream error codes, a tunnel's activity), conn.go
// (sockets), buffers.go, loglimit.go, panics.go (the panic guard of a
// tunnel's goroutines on both ends), stalls.go (a link's credit stalls:
// the metric, the log line and the status of both ends).
//
// # Locks
//
// Locks are taken in this order, never the other way round:
//
//	Server.mu → registry.mu → a link's locks (h2link: wmu, mu, a stream's rmu, ctlMu)
//	Agent.mu → a link's locks → tunnelGate.mu (the agent's links take tunnels under it)
//	grpcStream.mu → the gRPC front door link's locks (a write to the client)
//	a promtext family's lock → Server.mu, registry.mu, Agent.mu (a scrape's functions)
//
// Server.mu guards the server's state, its listeners, the tunnel table
// (Server.tunnels) with each tunnel's state, the held tunnels' paused
// tunnel (tunnel.handed) and the counts by state, and the count of gRPC
// front door connections; the quiet drain, the hang-up sweep and a
// restart pick tunnels under it and act on them after it is released.
// Server.mu also guards the handover's state (handover): it waits for
// the connections it takes and for the pauses of an agent's restart
// (handover.agentPausing) on handover.moved, whose lock is Server.mu. registry.mu
// (read-locked by a dial's pick) guards the connected agents and their
// index (registry_index.go); whether a link takes a stream is an atomic
// the link keeps, read without its locks. Agent.mu guards the agent's connections, counts and
// the destinations kept for a restart; tunnelGate.mu whether the agent
// takes tunnels (its drain shuts it once none is open), and its tunnel
// count goes up only under it. Leaf locks, under which nothing
// else is taken: tunnelGate.mu, upstreamAgent.mu, connCredential.mu, pendingConn.mu, upload.goneMu, replacements.mu,
// wire.WatchedConn's, wire.LogLimiter's and promtext's registry lock; nothing
// registers a metric under Server.mu, registry.mu or Agent.mu. Every
// other shared field is immutable once published, atomic, or owned by
// one goroutine, as its comment says.
//
// # Rules
//
// Lifecycles: every goroutine has an owner that ends it: the Server (Close
// waits for all it started) or the Agent (Run returns after its
// connections and tunnels ended). Package-level state is read-only (the
// table of a tunnel's states among it), apart from sync.Pools of buffers.
// The packages import tunnel/internal/h2link (the link),
// tunnel/internal/grpcwire (upstream's Packet wire format) and
// internal/promtext (metrics); they never import package main, auth or
// certs: authentication reaches the server as functions in server.Config.
//
// # Parked stacks
//
// An idle tunnel costs one goroutine in each process, parked on its
// socket's read: the frontend connection's on the server
// (serveFrontendConn), the stream handler's on the agent ((*Agent).carry).
// The dial and the first write grow these stacks to 8 KiB; the runtime
// halves a parked stack at a collection only while less than a quarter of it
// is in use (counting an 800-byte reserve), so the frames on the parked path
// must stay few and small. A call on the gRPC front door has no socket of
// its own to park on (its link reads for all its calls): its two
// directions are carried by carriers (tunnel.go) only while bytes move,
// and its handler, whose stack the dial grew, returns once the tunnel is
// open; what parks is the call's waiter (waitGRPC), started then with the
// runtime's smallest stack, which nothing on its parked path grows. Work that needs a large frame (the dial, the
// CONNECT head, a buffered copy) lives in a function that returns before
// the tunnel parks, and deferred work is one closure. TestIdleTunnelStacksShrink
// fails when the parked path grows; the comments that say "see Parked stacks"
// mark the functions that exist for this rule.
//
// An idle agent connection costs the server one goroutine, its link's read
// loop: the agent's control stream is read only when a line comes
// (controlWatch), and no goroutine waits for the connection to end.
package tunnel
