package wire

import (
	"context"
	"errors"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spinifex/konnectivity/internal/promtext"
	"github.com/spinifex/konnectivity/tunnel/internal/grpcwire"
	"github.com/spinifex/konnectivity/tunnel/internal/h2link"
)

// Upstream counts every gRPC Packet a process sends or receives, by the
// segment it travelled (stream_packets_total{segment,packet_type}). A
// tunnel here is an HTTP/2 stream, not a stream of Packets, so each event
// is counted as the Packet upstream would have sent for it:
//
//	CONNECT request from kube-apiserver, stream opened to an agent   DIAL_REQ
//	the dial's answer (200 or an error status, response HEADERS)     DIAL_RSP
//	one read from a socket sent on, one Packet on the gRPC frontend  DATA
//	the sender's end (EOF, END_STREAM), a client's CLOSE_REQ         CLOSE_REQ / CLOSE_RSP
//	a dial the client gave up (DIAL_CLS, RST_STREAM before 200)      DIAL_CLS
//	an agent announcing its drain                                    DRAIN
//
// Counting is one atomic add into a fixed array: no label lookup, no
// allocation.

// segment is the leg of a tunnel a Packet travelled, upstream's label.
type segment uint8

const (
	SegFromClient segment = iota // kube-apiserver → server
	SegToClient                  // server → kube-apiserver
	SegFromAgent                 // agent → server
	SegToAgent                   // server → agent
	numSegments
)

var segmentNames = [numSegments]string{"from_client", "to_client", "from_agent", "to_agent"}

const NumPacketTypes = int(grpcwire.Drain) + 1

// PacketCounts counts Packets by segment and type.
type PacketCounts struct {
	N [numSegments][NumPacketTypes]atomic.Uint64
}

func (p *PacketCounts) Inc(s segment, t grpcwire.Type) { p.N[s][t].Add(1) }

// Register exposes the counts of the given segments as name.
func (p *PacketCounts) Register(m *promtext.Registry, name string, segs ...segment) {
	const help = "Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ); HTTP/2 events count as the packet upstream sends for them."
	for _, s := range segs {
		for t := range NumPacketTypes {
			c := &p.N[s][t]
			m.CounterFunc(name, help, []string{"segment", "packet_type"}, []string{segmentNames[s], grpcwire.Type(t).String()},
				func() float64 { return float64(c.Load()) })
		}
	}
}

// Stream errors, upstream's stream_errors_total{segment,code,packet_type}:
// code is the gRPC status code upstream would have seen. An HTTP/2 stream
// reset by the peer is Canceled; a connection that broke is Unavailable.
const (
	CodeCanceled    = "Canceled"
	CodeUnavailable = "Unavailable"
)

// StreamErrors counts stream errors by segment and code; the packet type is
// the one in flight (DATA while carrying, DIAL_REQ while dialling).
type StreamErrors struct {
	n [numSegments][2][NumPacketTypes]atomic.Uint64
}

func (e *StreamErrors) Inc(s segment, code string, t grpcwire.Type) {
	c := 0
	if code == CodeUnavailable {
		c = 1
	}
	e.n[s][c][t].Add(1)
}

func (e *StreamErrors) Register(m *promtext.Registry, name string, segs ...segment) {
	const help = "Count of stream errors, by segment, gRPC code and packet type (example: from_agent, Unavailable, DATA); a reset HTTP/2 stream is Canceled, a broken connection Unavailable."
	for _, s := range segs {
		for c, code := range []string{CodeCanceled, CodeUnavailable} {
			for _, t := range []grpcwire.Type{grpcwire.DialReq, grpcwire.Data} {
				v := &e.n[s][c][t]
				m.CounterFunc(name, help, []string{"segment", "code", "packet_type"}, []string{segmentNames[s], code, t.String()},
					func() float64 { return float64(v.Load()) })
			}
		}
	}
}

// PacketWriter counts each write as one DATA Packet: one read from a
// socket, sent on as DATA frames.
type PacketWriter struct {
	W    io.Writer
	C    PacketCounter
	Up   *Activity // when set, each write is a read from the client
	Down *Activity // when set, each write goes toward the client
}

func (p *PacketWriter) Write(b []byte) (int, error) {
	p.C.Inc()
	if p.Up != nil {
		p.Up.Up()
	}
	n, err := p.W.Write(b)
	if p.Down != nil && n > 0 {
		p.Down.Down()
	}
	return n, err
}

// PacketWriters recycles the counting writers of tunnels that ended, so
// that counting costs no allocation per tunnel.
var PacketWriters = sync.Pool{New: func() any { return new(PacketWriter) }}

func PutPacketWriter(p *PacketWriter) {
	*p = PacketWriter{}
	PacketWriters.Put(p)
}

// PacketCounter is the counts one event adds to: up to two, since one
// read from a socket can be a Packet on two segments (from the client and
// to the agent).
type PacketCounter [2]*atomic.Uint64

func (c *PacketCounter) Inc() {
	for _, n := range c {
		if n != nil {
			n.Add(1)
		}
	}
}

// StreamErrorCode is the gRPC code upstream would report for err: a stream
// the peer reset is Canceled, anything else (a broken connection, a failed
// write) Unavailable.
func StreamErrorCode(err error) string {
	if errors.Is(err, h2link.ErrStreamReset) || errors.Is(err, context.Canceled) {
		return CodeCanceled
	}
	return CodeUnavailable
}

// Activity is a tunnel's traffic as a draining server sees it: a count of
// socket reads and writes, and which way the last went, in one word
// (count<<1 | 1 when the last went toward the client), and when the last
// write toward the client began. One atomic operation per read, two per
// write, no allocation, ordered: a read from the client after the last
// write always shows, and at is never older than the write v counts last.
type Activity struct {
	V  atomic.Uint64
	At atomic.Int64 // monotonic nanoseconds (clock) of the last down
}

// Clock is a monotonic reading in nanoseconds, comparable across
// goroutines of this process. clockBase is set once, before any tunnel.
func Clock() int64 { return int64(time.Since(clockBase)) }

var clockBase = time.Now()

// Up records a read from the client (bytes toward the agent).
func (a *Activity) Up() {
	for {
		o := a.V.Load()
		if a.V.CompareAndSwap(o, (o|1)+1) {
			return
		}
	}
}

// Down records a write toward the client. The time is stored first, so a
// drain that reads v and then at sees a time no older than that write.
func (a *Activity) Down() {
	a.At.Store(Clock())
	for {
		o := a.V.Load()
		if a.V.CompareAndSwap(o, (o+2)|1) {
			return
		}
	}
}

// QuietFor is how long ago the last write toward the client was, if it
// was the tunnel's last traffic; 0 if not (or if nothing went to it).
func (a *Activity) QuietFor() time.Duration {
	v, at := a.V.Load(), a.At.Load()
	if v&1 == 0 || a.V.Load() != v {
		return 0
	}
	return max(time.Duration(Clock()-at), 1)
}

// InheritQuiet counts the quiet a previous image of the process saw on the
// tunnel (PausedTunnel.Quiet) as already passed: the tunnel is quiet for d.
// Called before the tunnel carries bytes.
func (a *Activity) InheritQuiet(d time.Duration) {
	if d > 0 {
		a.At.Store(Clock() - int64(d))
		a.V.Store(1)
	}
}
