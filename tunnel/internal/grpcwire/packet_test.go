package grpcwire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"runtime"
	"strings"
	"testing"
)

func TestPacketRoundTrip(t *testing.T) {
	for _, p := range []Packet{
		{Type: DialReq, Protocol: "tcp", Address: "10.0.0.1:443", Random: 1<<62 + 5},
		{Type: DialRsp, Random: 7, ConnectID: 9},
		{Type: DialRsp, Random: 7, Error: "dial failed"},
		{Type: Data, ConnectID: 3, Data: []byte("hello")},
		{Type: CloseReq, ConnectID: 3},
		{Type: CloseRsp, ConnectID: 3, Error: "x"},
		{Type: DialCls, Random: 11},
		{Type: Drain},
		{Type: DialReq, Random: -1},
	} {
		got, err := Decode(Append(nil, p))
		if err != nil {
			t.Fatalf("%v: %v", p.Type, err)
		}
		if got.Type != p.Type || got.Protocol != p.Protocol || got.Address != p.Address || got.Random != p.Random ||
			got.ConnectID != p.ConnectID || got.Error != p.Error || !bytes.Equal(got.Data, p.Data) {
			t.Fatalf("round trip: %+v -> %+v", p, got)
		}
	}
}

// Bytes produced by the upstream protobuf encoder for
// Packet{type: DIAL_REQ, dialRequest: {protocol: "tcp", address: "127.0.0.1:80", random: 42}}.
func TestPacketDecodesUpstreamBytes(t *testing.T) {
	upstream := []byte{0x12, 0x15, 0x0a, 0x03, 't', 'c', 'p', 0x12, 0x0c, '1', '2', '7', '.', '0', '.', '0', '.', '1', ':', '8', '0', 0x18, 0x2a}
	p, err := Decode(upstream)
	if err != nil {
		t.Fatal(err)
	}
	if p.Type != DialReq || p.Protocol != "tcp" || p.Address != "127.0.0.1:80" || p.Random != 42 {
		t.Fatalf("decoded %+v", p)
	}
}

func FuzzDecodePacket(f *testing.F) {
	f.Add(Append(nil, Packet{Type: DialReq, Protocol: "tcp", Address: "a:1", Random: 3}))
	f.Add(Append(nil, Packet{Type: Data, ConnectID: 1, Data: []byte("xyz")}))
	f.Add(Append(nil, Packet{Type: CloseRsp, ConnectID: 1, Error: "e"}))
	f.Add([]byte{0x08, 0x04, 0x22, 0x00})
	f.Add([]byte{0x08, 0x63})
	f.Add([]byte{0x0b})
	f.Add([]byte{0x12, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := Decode(b)
		if err != nil {
			return
		}
		again, err := Decode(Append(nil, p))
		if err != nil {
			t.Fatalf("re-encoded packet does not decode: %v", err)
		}
		if again.Type != p.Type || again.Address != p.Address || again.ConnectID != p.ConnectID || !bytes.Equal(again.Data, p.Data) {
			t.Fatalf("re-encode changed %+v into %+v", p, again)
		}
	})
}

func FuzzReadGRPCMessage(f *testing.F) {
	f.Add(AppendMessage(nil, Packet{Type: DialReq, Address: "a:1"}))
	f.Add([]byte{1, 0, 0, 0, 1, 0})
	f.Add([]byte{0, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		var buf []byte
		for range 100 {
			msg, nbuf, err := ReadMessage(r, buf, MaxMessageLen)
			buf = nbuf
			if err != nil {
				return
			}
			if len(msg) > MaxMessageLen {
				t.Fatal("message over the limit accepted")
			}
			Decode(msg)
		}
	})
}

// stingyReader returns its bytes and then EOF, a few at a time.
type stingyReader struct{ b []byte }

func (r *stingyReader) Read(p []byte) (int, error) {
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), 3)], r.b)
	r.b = r.b[n:]
	return n, nil
}

// A message announced at 16 MiB costs what arrives, not what is announced.
func TestGRPCMessageGrowsAsBytesArrive(t *testing.T) {
	hdr := []byte{0, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(hdr[1:], MaxMessageLen)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, _, err := ReadMessage(&stingyReader{append(hdr, "only ten b"...)}, nil, MaxMessageLen)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("truncated message: %v", err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 2*GrowStep {
		t.Fatalf("10 bytes of a message announced at 16 MiB allocated %d bytes", got)
	}

	// A message that does arrive whole, across many reads and growths, is
	// returned intact, and a buffer that fits is reused as is.
	for _, n := range []int{0, 1, GrowStep - 1, GrowStep, GrowStep + 1, 5*GrowStep + 7, 1 << 20} {
		payload := bytes.Repeat([]byte("0123456789abcdef"), n/16+1)[:n]
		wire := append([]byte{0, 0, 0, 0, 0}, payload...)
		binary.BigEndian.PutUint32(wire[1:], uint32(n))
		msg, buf, err := ReadMessage(bytes.NewReader(wire), make([]byte, 0, 100), MaxMessageLen)
		if err != nil || !bytes.Equal(msg, payload) {
			t.Fatalf("%d bytes: %v, equal %v", n, err, bytes.Equal(msg, payload))
		}
		if n <= 100 && cap(buf) != 100 {
			t.Fatalf("%d bytes: a buffer that fitted was replaced", n)
		}
	}
	if _, _, err := ReadMessage(bytes.NewReader([]byte{0, 0, 0, 0x10, 1}), nil, MaxDialRequestLen); err == nil || !strings.Contains(err.Error(), "exceeds the 4096 limit") {
		t.Fatalf("a first message over the cap: %v", err)
	}
}

// maxDataMessagePayload is the largest payload tunnel frames: its large
// buffer (128 KiB) less the room for the prefix.
const maxDataMessagePayload = 128<<10 - DataPrefixRoom

func TestPutDataPrefixMatchesEncoder(t *testing.T) {
	for _, n := range []int{1, 127, 128, 16383, 16384, maxDataMessagePayload} {
		for _, id := range []int64{1, 300, 1 << 40} {
			buf := make([]byte, DataPrefixRoom+n)
			for i := range n {
				buf[DataPrefixRoom+i] = byte(i)
			}
			got := PutDataPrefix(buf, id, n)
			want := AppendMessage(nil, Packet{Type: Data, ConnectID: id, Data: buf[DataPrefixRoom : DataPrefixRoom+n]})
			if !bytes.Equal(got, want) {
				t.Fatalf("n=%d id=%d: framing differs from the encoder", n, id)
			}
		}
	}
}

// pausingReader returns its bytes a few at a time and errPause after
// every pauseEvery reads, as a connection stopped for a handover does.
type pausingReader struct {
	b          []byte
	reads      int
	pauseEvery int
}

var errPause = errors.New("paused")

func (r *pausingReader) Read(p []byte) (int, error) {
	r.reads++
	if r.reads%r.pauseEvery == 0 {
		return 0, errPause
	}
	if len(r.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), 7)], r.b)
	r.b = r.b[n:]
	return n, nil
}

// FuzzMessageReaderResumes: a MessageReader whose source stops now and
// then, and whose incomplete message moves to a new reader at each stop
// (Partial, Prime), returns exactly what ReadMessage returns from the
// same bytes read in one go.
func FuzzMessageReaderResumes(f *testing.F) {
	var two []byte
	two = AppendMessage(two, Packet{Type: DialReq, Address: "a:1"})
	two = AppendMessage(two, Packet{Type: Data, ConnectID: 7, Data: bytes.Repeat([]byte("x"), 300)})
	f.Add(two, uint8(3))
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 9}, uint8(2))
	f.Add([]byte{1, 0, 0, 0, 1, 0}, uint8(5))
	f.Add([]byte{0, 0xff, 0xff, 0xff, 0xff}, uint8(4))
	f.Fuzz(func(t *testing.T, b []byte, every uint8) {
		var want [][]byte
		var wantErr bool
		r := bytes.NewReader(b)
		for range 100 {
			msg, _, err := ReadMessage(r, nil, 1<<16)
			if err != nil {
				wantErr = !errors.Is(err, io.EOF)
				break
			}
			want = append(want, append([]byte(nil), msg...))
		}
		src := &pausingReader{b: b, pauseEvery: 2 + int(every%8)}
		mr := NewMessageReader(nil, 1<<16)
		var got [][]byte
		var gotErr bool
		for range 100 + len(b) {
			msg, err := mr.Next(src)
			if errors.Is(err, errPause) {
				next := NewMessageReader(make([]byte, 0, 16), 1<<16)
				next.Prime(mr.Partial())
				mr = next
				continue
			}
			if err != nil {
				gotErr = !errors.Is(err, io.EOF)
				break
			}
			got = append(got, append([]byte(nil), msg...))
		}
		if len(got) != len(want) || gotErr != wantErr {
			t.Fatalf("got %d messages (error %v), want %d (error %v)", len(got), gotErr, len(want), wantErr)
		}
		for i := range want {
			if !bytes.Equal(got[i], want[i]) {
				t.Fatalf("message %d differs", i)
			}
		}
	})
}
