// Package h2link is the tunnel's HTTP/2: one connection, either end,
// written for carrying many long byte streams with few goroutines, few
// copies and one system call per write.
//
// The one idea: whoever has bytes writes the frame itself, under one
// lock, in one system call; the read loop gives a DATA payload straight to
// the stream's reader, or to its socket (sink.go). x/net's Transport parks
// a goroutine per stream holding a 64 KiB scratch buffer, and its Server
// passes every frame through its serve loop goroutine; neither fits a
// process holding thousands of quiet tunnels.
//
// The rules that keep it simple:
//   - The read loop never blocks on a write. Control frames it must send
//     (SETTINGS and PING acknowledgements, WINDOW_UPDATE, RST_STREAM)
//     go through a queue that whoever holds the write lock flushes; the
//     queue is bounded (Config.MaxQueuedControl) and a peer that fills it
//     without reading is dropped with ENHANCE_YOUR_CALM.
//   - Every frame write is one call on the connection.
//   - Writers take turns (sched.go): the write lock is given in
//     the order writers asked, control frames, header blocks and small
//     writes ahead of bulk turns; a bulk turn writes what the link sends
//     in about 2 ms, and the TCP socket's unsent bytes are bounded to a
//     turn, so a small write waits behind little.
//   - Receive windows follow the link (bdp.go): the receiving end
//     measures round trips and bytes delivered with a PING; the
//     connection window is what the link needs plus a short queue, a
//     stream's twice the link's bandwidth-delay product (1 to 16 MiB).
//   - A stream has the states of RFC 9113 §5.1 (stream.go); it leaves the
//     connection's map once closed, and, on the serving end, counts
//     against Config.MaxConcurrentStreams until its handler has returned
//     as well. Peers that reset streams whose handlers still run spend a
//     budget (Config.MaxPeerResets); an empty budget drops them.
//   - Flow-control windows are the window type (flow.go), bounded at
//     2^31-1 as the RFC says; an overflow is a FLOW_CONTROL_ERROR of the
//     stream or the connection.
//   - Send credit is given out in order (credit.go): a writer waits on
//     its own stream's condition, for its stream's credit or in the
//     connection's first-come queue for the connection's, and whoever
//     changes what the first in line may take wakes it, so no credit sits
//     unused while a writer that could use it waits, and no writer is
//     passed over by one that asked later. What these rules say cannot
//     happen, connection credit that does not come or credit owed and not
//     returned, is looked for all the same (stall.go): each such credit
//     stall is told once (Config.OnCreditStall) and counted on the link
//     (CheckCredit).
//   - Locks, outermost first: Conn.wmu, Conn.mu, a stream's rmu,
//     Conn.ctlMu; the Batcher's lock is a leaf. Each field says which
//     lock guards it or which goroutine owns it. A method whose name ends
//     in Locked expects its caller to hold Conn.mu; RLocked, the stream's
//     rmu; WLocked, Conn.wmu.
//   - Conn.wmu is a writeLock (wlock.go): its owners only write, so one
//     that has it longer than Config.StallAfter is a peer that does not read.
//     Such a connection takes no new stream; RoundTrip waits for the lock
//     no longer than its context, and gives up on a stalled connection
//     with ErrStalled (the peer saw nothing: try elsewhere). The write
//     deadline (KeepAlive + PingTimeout) closes it.
//
// Roles: NewClient is the end that opens streams (RoundTrip); NewServer
// is the end that serves the streams its peer opens with an http.Handler
// (Serve runs its read loop). A serving end that faces a peer before it
// is admitted starts with Config.PreAdmitStreamWindow and
// PreAdmitConnWindow; its owner calls (*Conn).RaiseWindows after
// admission to give the full windows.
//
// A serving end made with Config.Freezable can move to another process
// on the same socket: StopReading stops its read loop at a frame
// boundary, handlers let their streams go with Detach, and the rest is in
// freeze.go. A client end's upload that returns ErrUploadStopped stops
// without ending its stream.
//
// The package knows nothing of its users: an upload that sends itself
// implements SendTo(io.Writer) error (and CallerSends() bool when its
// caller sends it through (*Body).SendUpload; such an upload may park,
// ErrUploadParked, and its caller sends on later); a connection whose
// writes should be gathered passes its Batcher in Config.Batch; a caller
// that counts the writes DeliverTo makes for it, or watches a stream's
// last activity, sets (*Body).OnWrite; a serving end's owner that counts
// its streams from the moment the link takes them, or refuses them
// unprocessed (REFUSED_STREAM), chooses each stream's handler in
// Config.Take. A reader that holds no goroutine
// while a stream is quiet asks (*Body).Notify to be told when it has
// bytes; a handler whose response outlives it calls Outlive.
package h2link
