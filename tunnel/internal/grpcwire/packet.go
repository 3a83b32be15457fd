package grpcwire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// ProxyMethod is the path of the bidirectional gRPC call that carries a
// dial's Packets (proxyProtocol GRPC's ProxyService.Proxy).
const ProxyMethod = "/ProxyService/Proxy"

// Type is a Packet's type field: which payload it carries.
type Type int32

const (
	DialReq  Type = 0
	DialRsp  Type = 1
	CloseReq Type = 2
	CloseRsp Type = 3
	Data     Type = 4
	DialCls  Type = 5
	Drain    Type = 6
)

func (t Type) String() string {
	switch t {
	case DialReq:
		return "DIAL_REQ"
	case DialRsp:
		return "DIAL_RSP"
	case CloseReq:
		return "CLOSE_REQ"
	case CloseRsp:
		return "CLOSE_RSP"
	case Data:
		return "DATA"
	case DialCls:
		return "DIAL_CLS"
	case Drain:
		return "DRAIN"
	}
	return fmt.Sprintf("Unknown(%d)", int32(t))
}

// Packet holds the union of every payload's fields; which are meaningful
// depends on Type.
type Packet struct {
	Type      Type
	Protocol  string // DIAL_REQ
	Address   string // DIAL_REQ
	Random    int64  // DIAL_REQ, DIAL_RSP, DIAL_CLS
	ConnectID int64  // DIAL_RSP, CLOSE_REQ, CLOSE_RSP, DATA
	Error     string // DIAL_RSP, CLOSE_RSP, DATA
	Data      []byte // DATA
}

// Packet field numbers, and the payload message each one carries.
const (
	fieldType         = 1
	fieldDialRequest  = 2
	fieldDialResponse = 3
	fieldData         = 4
	fieldCloseRequest = 5
	fieldCloseResp    = 6
	fieldCloseDial    = 7
	fieldDrain        = 8
)

const (
	wireVarint  = 0
	wireFixed64 = 1
	wireBytes   = 2
	wireFixed32 = 5
)

var errMalformed = errors.New("malformed protobuf")

// Decode parses a Packet. Unknown fields are skipped, as protobuf
// requires; a payload that does not match the type is an error.
func Decode(b []byte) (Packet, error) {
	var p Packet
	payloadField := 0
	err := eachField(b, func(num int, wt int, v uint64, data []byte) error {
		switch {
		case num == fieldType && wt == wireVarint:
			p.Type = Type(int32(v))
		case num >= fieldDialRequest && num <= fieldDrain && wt == wireBytes:
			payloadField = num
			return decodePayload(&p, num, data)
		}
		return nil
	})
	if err != nil {
		return p, err
	}
	want := map[Type]int{
		DialReq: fieldDialRequest, DialRsp: fieldDialResponse, CloseReq: fieldCloseRequest,
		CloseRsp: fieldCloseResp, Data: fieldData, DialCls: fieldCloseDial, Drain: fieldDrain,
	}[p.Type]
	if want == 0 {
		return p, fmt.Errorf("unknown packet type %d", int32(p.Type))
	}
	if payloadField != 0 && payloadField != want {
		return p, fmt.Errorf("%s packet carries payload field %d", p.Type, payloadField)
	}
	return p, nil
}

func decodePayload(p *Packet, field int, b []byte) error {
	return eachField(b, func(num int, wt int, v uint64, data []byte) error {
		str := func(dst *string) error {
			if wt != wireBytes {
				return errMalformed
			}
			*dst = string(data)
			return nil
		}
		i64 := func(dst *int64) error {
			if wt != wireVarint {
				return errMalformed
			}
			*dst = int64(v)
			return nil
		}
		switch field {
		case fieldDialRequest:
			switch num {
			case 1:
				return str(&p.Protocol)
			case 2:
				return str(&p.Address)
			case 3:
				return i64(&p.Random)
			}
		case fieldDialResponse:
			switch num {
			case 1:
				return str(&p.Error)
			case 2:
				return i64(&p.ConnectID)
			case 3:
				return i64(&p.Random)
			}
		case fieldData:
			switch num {
			case 1:
				return i64(&p.ConnectID)
			case 2:
				return str(&p.Error)
			case 3:
				if wt != wireBytes {
					return errMalformed
				}
				p.Data = data
			}
		case fieldCloseRequest:
			if num == 1 {
				return i64(&p.ConnectID)
			}
		case fieldCloseResp:
			switch num {
			case 1:
				return str(&p.Error)
			case 2:
				return i64(&p.ConnectID)
			}
		case fieldCloseDial:
			if num == 1 {
				return i64(&p.Random)
			}
		}
		return nil
	})
}

// eachField walks the fields of one message. For varints v holds the
// value; for length-delimited fields data holds the bytes (aliasing b).
func eachField(b []byte, f func(num int, wt int, v uint64, data []byte) error) error {
	for len(b) > 0 {
		tag, n := binary.Uvarint(b)
		if n <= 0 {
			return errMalformed
		}
		b = b[n:]
		num, wt := int(tag>>3), int(tag&7)
		if num < 1 || tag>>3 > 1<<29-1 {
			return errMalformed
		}
		var v uint64
		var data []byte
		switch wt {
		case wireVarint:
			if v, n = binary.Uvarint(b); n <= 0 {
				return errMalformed
			}
			b = b[n:]
		case wireFixed64:
			if len(b) < 8 {
				return errMalformed
			}
			b = b[8:]
		case wireFixed32:
			if len(b) < 4 {
				return errMalformed
			}
			b = b[4:]
		case wireBytes:
			l, n := binary.Uvarint(b)
			if n <= 0 || l > uint64(len(b)-n) {
				return errMalformed
			}
			data = b[n : n+int(l)]
			b = b[n+int(l):]
		default:
			return errMalformed // groups are not used by this protocol
		}
		if err := f(num, wt, v, data); err != nil {
			return err
		}
	}
	return nil
}

// Append encodes p. Zero values are omitted, as proto3 does.
func Append(dst []byte, p Packet) []byte {
	if p.Type != 0 {
		dst = appendVarintField(dst, fieldType, uint64(p.Type))
	}
	var payload []byte
	field := 0
	switch p.Type {
	case DialReq:
		field = fieldDialRequest
		payload = appendStringField(payload, 1, p.Protocol)
		payload = appendStringField(payload, 2, p.Address)
		payload = appendVarintField(payload, 3, uint64(p.Random))
	case DialRsp:
		field = fieldDialResponse
		payload = appendStringField(payload, 1, p.Error)
		payload = appendVarintField(payload, 2, uint64(p.ConnectID))
		payload = appendVarintField(payload, 3, uint64(p.Random))
	case Data:
		field = fieldData
		payload = appendVarintField(payload, 1, uint64(p.ConnectID))
		payload = appendStringField(payload, 2, p.Error)
		payload = appendStringField(payload, 3, string(p.Data))
	case CloseReq:
		field = fieldCloseRequest
		payload = appendVarintField(payload, 1, uint64(p.ConnectID))
	case CloseRsp:
		field = fieldCloseResp
		payload = appendStringField(payload, 1, p.Error)
		payload = appendVarintField(payload, 2, uint64(p.ConnectID))
	case DialCls:
		field = fieldCloseDial
		payload = appendVarintField(payload, 1, uint64(p.Random))
	case Drain:
		field = fieldDrain
	}
	// The oneof payload is present even when empty, so the receiver sees
	// which message it is.
	dst = binary.AppendUvarint(dst, uint64(field)<<3|wireBytes)
	dst = binary.AppendUvarint(dst, uint64(len(payload)))
	return append(dst, payload...)
}

func appendVarintField(dst []byte, num int, v uint64) []byte {
	if v == 0 {
		return dst
	}
	dst = binary.AppendUvarint(dst, uint64(num)<<3|wireVarint)
	return binary.AppendUvarint(dst, v)
}

func appendStringField(dst []byte, num int, s string) []byte {
	if s == "" {
		return dst
	}
	dst = binary.AppendUvarint(dst, uint64(num)<<3|wireBytes)
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

// gRPC length-prefixed messages: a compression flag byte and a big-endian
// uint32 length, then the message.
const (
	HeaderLen     = 5
	MaxMessageLen = 16 << 20
	// MaxDialRequestLen bounds the first message of a call, the DIAL_REQ:
	// its address is at most a 253-byte name and a port, so a few hundred
	// bytes; the rest is room for fields a newer client may add.
	MaxDialRequestLen = 4 << 10
	// GrowStep is the first allocation for a message larger than the
	// buffer at hand; the buffer then doubles as bytes arrive, so an
	// announced length costs memory only once it is sent.
	GrowStep = 32 << 10
)

// ReadMessage reads one message of at most limit bytes into buf and
// returns the message bytes, which alias the returned buffer (buf, or a
// larger one that replaces it). A larger buffer grows with the bytes that
// arrive, never to the announced length ahead of them.
func ReadMessage(r io.Reader, buf []byte, limit int) ([]byte, []byte, error) {
	var hdr [HeaderLen]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, buf, fmt.Errorf("truncated gRPC message header: %w", err)
		}
		return nil, buf, err
	}
	if hdr[0] != 0 {
		return nil, buf, fmt.Errorf("compressed gRPC messages are not supported (flag %d)", hdr[0])
	}
	n64 := uint64(binary.BigEndian.Uint32(hdr[1:]))
	if n64 > uint64(limit) {
		return nil, buf, fmt.Errorf("gRPC message of %d bytes exceeds the %d limit", n64, limit)
	}
	n := int(n64)
	if cap(buf) >= n {
		msg := buf[:n]
		if _, err := io.ReadFull(r, msg); err != nil {
			return nil, buf, fmt.Errorf("truncated gRPC message: %w", io.ErrUnexpectedEOF)
		}
		return msg, buf, nil
	}
	msg := buf[:0]
	for len(msg) < n {
		if len(msg) == cap(msg) {
			grown := make([]byte, len(msg), min(max(2*cap(msg), GrowStep), n))
			copy(grown, msg)
			msg = grown
		}
		m, err := r.Read(msg[len(msg):cap(msg)])
		msg = msg[:len(msg)+m]
		if err != nil && len(msg) < n {
			return nil, msg[:0], fmt.Errorf("truncated gRPC message: %w", io.ErrUnexpectedEOF)
		}
	}
	return msg, msg, nil
}

// MessageReader reads gRPC messages from a stream one at a time, like
// ReadMessage, but keeps a message cut short by a read error: the next
// Next goes on where it stopped, and Partial returns the bytes read so
// far, which Prime gives to another reader (a handover to another
// process). It reads no byte past the message it returns.
type MessageReader struct {
	Limit int    // the largest message accepted
	buf   []byte // the current message as received: prefix, then payload
}

// NewMessageReader reads messages of at most limit bytes into buf's
// storage, growing it as bytes arrive.
func NewMessageReader(buf []byte, limit int) *MessageReader {
	return &MessageReader{Limit: limit, buf: buf[:0]}
}

// Next returns the next message, which aliases the reader's buffer until
// the following call. After a read error the message's bytes read so far
// stay in place; io.EOF before any byte of a message is returned as is, in the
// middle of one as io.ErrUnexpectedEOF.
func (m *MessageReader) Next(r io.Reader) ([]byte, error) {
	for {
		need := HeaderLen
		if len(m.buf) >= HeaderLen {
			if m.buf[0] != 0 {
				return nil, fmt.Errorf("compressed gRPC messages are not supported (flag %d)", m.buf[0])
			}
			n64 := uint64(binary.BigEndian.Uint32(m.buf[1:HeaderLen]))
			if n64 > uint64(m.Limit) {
				return nil, fmt.Errorf("gRPC message of %d bytes exceeds the %d limit", n64, m.Limit)
			}
			need += int(n64)
			if len(m.buf) == need {
				msg := m.buf[HeaderLen:need]
				m.buf = m.buf[:0]
				return msg, nil
			}
		}
		if len(m.buf) == cap(m.buf) {
			// Grow with what arrives, never to the announced length ahead of it.
			grown := make([]byte, len(m.buf), min(max(2*cap(m.buf), GrowStep), need))
			copy(grown, m.buf)
			m.buf = grown
		}
		k, err := r.Read(m.buf[len(m.buf):min(need, cap(m.buf))])
		m.buf = m.buf[:len(m.buf)+k]
		if err != nil && len(m.buf) < need {
			if errors.Is(err, io.EOF) && len(m.buf) > 0 {
				return nil, fmt.Errorf("truncated gRPC message: %w", io.ErrUnexpectedEOF)
			}
			return nil, err
		}
	}
}

// Partial is the incomplete message's bytes read so far (prefix
// included), empty at a message boundary. It aliases the buffer.
func (m *MessageReader) Partial() []byte { return m.buf }

// Prime makes b (another reader's Partial) the start of the next message.
func (m *MessageReader) Prime(b []byte) { m.buf = append(m.buf[:0], b...) }

// AppendMessage encodes p as one gRPC length-prefixed message.
func AppendMessage(dst []byte, p Packet) []byte {
	start := len(dst)
	dst = append(dst, 0, 0, 0, 0, 0)
	dst = Append(dst, p)
	binary.BigEndian.PutUint32(dst[start+1:], uint32(len(dst)-start-HeaderLen))
	return dst
}

// DataPrefixRoom is the most a DATA message's framing and fields can take
// in front of its payload: gRPC header 5, type 2, payload tag 1 + length 5,
// connectID tag 1 + 10, data tag 1 + length 5.
const DataPrefixRoom = 32

// PutDataPrefix frames buf[DataPrefixRoom:DataPrefixRoom+n] as a gRPC
// message holding Packet{type: DATA, data: {connectID, data}}, writing the
// prefix just in front of the payload, and returns the whole message.
// n must be at least 1.
func PutDataPrefix(buf []byte, connectID int64, n int) []byte {
	var inner [32]byte
	data := inner[:0]
	data = appendVarintField(data, 1, uint64(connectID))
	data = binary.AppendUvarint(data, 3<<3|wireBytes)
	data = binary.AppendUvarint(data, uint64(n))
	dataMsgLen := len(data) + n

	var outer [32]byte
	head := outer[:0]
	head = append(head, 0, 0, 0, 0, 0) // gRPC header, length filled below
	head = appendVarintField(head, fieldType, uint64(Data))
	head = binary.AppendUvarint(head, fieldData<<3|wireBytes)
	head = binary.AppendUvarint(head, uint64(dataMsgLen))
	head = append(head, data...)
	binary.BigEndian.PutUint32(head[1:5], uint32(len(head)-HeaderLen+n))

	start := DataPrefixRoom - len(head)
	copy(buf[start:], head)
	return buf[start : DataPrefixRoom+n]
}
