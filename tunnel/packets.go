package tunnel

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
	segFromClient segment = iota // kube-apiserver → server
	segToClient                  // server → kube-apiserver
	segFromAgent                 // agent → server
	segToAgent                   // server → agent
	numSegments
)

var segmentNames = [numSegments]string{"from_client", "to_client", "from_agent", "to_agent"}

const numPacketTypes = int(grpcwire.Drain) + 1

// packetCounts counts Packets by segment and type.
type packetCounts struct {
	n [numSegments][numPacketTypes]atomic.Uint64
}

func (p *packetCounts) inc(s segment, t grpcwire.Type) { p.n[s][t].Add(1) }

// register exposes the counts of the given segments as name.
func (p *packetCounts) register(m *promtext.Registry, name string, segs ...segment) {
	const help = "Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ); HTTP/2 events count as the packet upstream sends for them."
	for _, s := range segs {
		for t := range numPacketTypes {
			c := &p.n[s][t]
			m.CounterFunc(name, help, []string{"segment", "packet_type"}, []string{segmentNames[s], grpcwire.Type(t).String()},
				func() float64 { return float64(c.Load()) })
		}
	}
}

// Stream errors, upstream's stream_errors_total{segment,code,packet_type}:
// code is the gRPC status code upstream would have seen. An HTTP/2 stream
// reset by the peer is Canceled; a connection that broke is Unavailable.
const (
	codeCanceled    = "Canceled"
	codeUnavailable = "Unavailable"
)

// streamErrors counts stream errors by segment and code; the packet type is
// the one in flight (DATA while carrying, DIAL_REQ while dialling).
type streamErrors struct {
	n [numSegments][2][numPacketTypes]atomic.Uint64
}

func (e *streamErrors) inc(s segment, code string, t grpcwire.Type) {
	c := 0
	if code == codeUnavailable {
		c = 1
	}
	e.n[s][c][t].Add(1)
}

func (e *streamErrors) register(m *promtext.Registry, name string, segs ...segment) {
	const help = "Count of stream errors, by segment, gRPC code and packet type (example: from_agent, Unavailable, DATA); a reset HTTP/2 stream is Canceled, a broken connection Unavailable."
	for _, s := range segs {
		for c, code := range []string{codeCanceled, codeUnavailable} {
			for _, t := range []grpcwire.Type{grpcwire.DialReq, grpcwire.Data} {
				v := &e.n[s][c][t]
				m.CounterFunc(name, help, []string{"segment", "code", "packet_type"}, []string{segmentNames[s], code, t.String()},
					func() float64 { return float64(v.Load()) })
			}
		}
	}
}

// packetWriter counts each write as one DATA Packet: one read from a
// socket, sent on as DATA frames.
type packetWriter struct {
	w    io.Writer
	c    packetCounter
	up   *activity // when set, each write is a read from the client
	down *activity // when set, each write goes toward the client
}

func (p *packetWriter) Write(b []byte) (int, error) {
	p.c.inc()
	if p.up != nil {
		p.up.up()
	}
	n, err := p.w.Write(b)
	if p.down != nil && n > 0 {
		p.down.down()
	}
	return n, err
}

// packetWriters recycles the counting writers of tunnels that ended, so
// that counting costs no allocation per tunnel.
var packetWriters = sync.Pool{New: func() any { return new(packetWriter) }}

func putPacketWriter(p *packetWriter) {
	*p = packetWriter{}
	packetWriters.Put(p)
}

// packetCounter is the counts one event adds to: up to two, since one
// read from a socket can be a Packet on two segments (from the client and
// to the agent).
type packetCounter [2]*atomic.Uint64

func (c *packetCounter) inc() {
	for _, n := range c {
		if n != nil {
			n.Add(1)
		}
	}
}

// streamErrorCode is the gRPC code upstream would report for err: a stream
// the peer reset is Canceled, anything else (a broken connection, a failed
// write) Unavailable.
func streamErrorCode(err error) string {
	if errors.Is(err, h2link.ErrStreamReset) || errors.Is(err, context.Canceled) {
		return codeCanceled
	}
	return codeUnavailable
}

// activity is a tunnel's traffic as a draining server sees it: a count of
// socket reads and writes, and which way the last went, in one word
// (count<<1 | 1 when the last went toward the client), and when the last
// write toward the client began. One atomic operation per read, two per
// write, no allocation, ordered: a read from the client after the last
// write always shows, and at is never older than the write v counts last.
type activity struct {
	v  atomic.Uint64
	at atomic.Int64 // monotonic nanoseconds (clock) of the last down
}

// clock is a monotonic reading in nanoseconds, comparable across
// goroutines of this process. clockBase is set once, before any tunnel.
func clock() int64 { return int64(time.Since(clockBase)) }

var clockBase = time.Now()

// up records a read from the client (bytes toward the agent).
func (a *activity) up() {
	for {
		o := a.v.Load()
		if a.v.CompareAndSwap(o, (o|1)+1) {
			return
		}
	}
}

// down records a write toward the client. The time is stored first, so a
// drain that reads v and then at sees a time no older than that write.
func (a *activity) down() {
	a.at.Store(clock())
	for {
		o := a.v.Load()
		if a.v.CompareAndSwap(o, (o+2)|1) {
			return
		}
	}
}

// quietFor is how long ago the last write toward the client was, if it
// was the tunnel's last traffic; 0 if not (or if nothing went to it).
func (a *activity) quietFor() time.Duration {
	v, at := a.v.Load(), a.at.Load()
	if v&1 == 0 || a.v.Load() != v {
		return 0
	}
	return max(time.Duration(clock()-at), 1)
}

// carryQuiet counts the quiet a previous image of the process saw on the
// tunnel (PausedTunnel.Quiet) as already passed: the tunnel is quiet for d.
// Called before the tunnel carries bytes.
func (a *activity) carryQuiet(d time.Duration) {
	if d > 0 {
		a.at.Store(clock() - int64(d))
		a.v.Store(1)
	}
}
