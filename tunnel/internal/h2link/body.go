package h2link

import (
	"errors"
	"io"
	"sync"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Body is what the peer sends on a stream: the response body on the client
// end, the request body on the serving end.
type Body struct {
	st *stream // immutable
}

// StreamID is the stream's HTTP/2 identifier, the same at both ends of the
// connection: how a control request names a stream.
func (b *Body) StreamID() uint32 { return b.st.id }

// SendUpload sends the request body of a stream whose caller sends it (a
// body with CallerSends true), until the body ends or the stream does.
func (b *Body) SendUpload() { b.st.pumpUpload() }

func (b *Body) Read(p []byte) (int, error) {
	st := b.st
	st.rmu.Lock()
	defer st.rmu.Unlock()
	for len(st.queue) == 0 && !st.eof && st.recvErr == nil && !st.readerGone && !st.l.readStopped() {
		st.recvCond.Wait()
	}
	if st.readerGone {
		return 0, errors.New("read on a closed response body")
	}
	if len(st.queue) == 0 {
		switch {
		case st.recvErr != nil:
			return 0, st.recvErr
		case st.eof:
			return 0, io.EOF
		}
		return 0, ErrReadStopped
	}
	n := 0
	for n < len(p) && len(st.queue) > 0 {
		chunk := *st.queue[0]
		c := copy(p[n:], chunk[st.head:])
		n += c
		st.head += c
		if st.head == len(chunk) {
			putChunk(st.queue[0])
			st.queue[0] = nil
			st.queue = st.queue[1:]
			st.head = 0
		}
	}
	if len(st.queue) == 0 {
		st.queue = nil // let the slice's array go while idle
	}
	st.queuedRLocked(-int64(n))
	st.unacked += int64(n)
	st.refillRLocked()
	return n, nil
}

// WriteTo writes what the peer sends to w as it arrives, straight from the
// received chunks: no copy buffer, and none taken while the stream is quiet.
// It returns nil at the stream's clean end.
func (b *Body) WriteTo(w io.Writer) (int64, error) {
	st := b.st
	var written int64
	for {
		st.rmu.Lock()
		for len(st.queue) == 0 && !st.eof && st.recvErr == nil && !st.readerGone {
			st.recvCond.Wait()
		}
		if st.readerGone {
			st.rmu.Unlock()
			return written, errors.New("read on a closed response body")
		}
		if len(st.queue) == 0 {
			err := st.recvErr
			st.rmu.Unlock()
			return written, err // nil at END_STREAM
		}
		// Take everything queued: several chunks leave in one writev.
		chunks, head := st.queue, st.head
		st.queue, st.head = nil, 0
		st.rmu.Unlock()

		n, taken, err := writeChunks(w, chunks, head)
		written += n
		st.rmu.Lock()
		if n > 0 && st.onWrite != nil {
			st.onWrite(int(n))
		}
		st.unacked += int64(taken) // off the queue, written or not: credit it all
		st.queuedRLocked(-int64(taken))
		st.refillRLocked()
		st.rmu.Unlock()
		if err != nil {
			return written, err
		}
	}
}

// Notify serves a reader that holds no goroutine, and no buffer, while
// the stream is quiet. When a Read would not block (bytes are queued, the
// stream ended or failed, the body was closed or reading stopped for a
// handover) it reports true; otherwise it keeps f, reports false, and
// runs f once a Read would not block. f runs once, outside every lock, on
// whichever goroutine changed the stream (often the link's read loop), so
// it must not block: it starts the reader's next goroutine. One f at a
// time (a later call replaces an earlier one's); not with DeliverTo.
func (b *Body) Notify(f func()) (ready bool) {
	st := b.st
	st.rmu.Lock()
	defer st.rmu.Unlock()
	if st.readableRLocked() {
		st.notify = nil
		return true
	}
	st.notify = f
	return false
}

// Close stops reading; a stream still open is reset (CANCEL).
func (b *Body) Close() error {
	st := b.st
	st.rmu.Lock()
	if st.readerGone {
		st.rmu.Unlock()
		return nil
	}
	st.readerGone = true
	st.dropQueueRLocked()
	complete := st.eof
	next := st.wakeRLocked()
	st.rmu.Unlock()
	next()
	if st.l.serving {
		// The handler stops reading its request: what still comes
		// is dropped and credited, and its end says RST_STREAM(NO_ERROR).
		return nil
	}
	if complete {
		l := st.l
		l.mu.Lock()
		sent := st.sentEndLocked()
		l.mu.Unlock()
		if sent {
			st.remove()
			return nil
		}
	}
	st.reset(http2.ErrCodeCancel, ErrStreamReset)
	return nil
}

// smallChunkSize is a chunk for the short writes of interactive streams.
const smallChunkSize = 4 << 10

// Received payloads are copied into pooled chunks: a small one for the
// short writes of interactive streams, a frame-sized one for bulk.
// The pools are immutable after init (a sync.Pool is safe for concurrent use).
var (
	smallChunks = sync.Pool{New: func() any { b := make([]byte, 0, smallChunkSize); return &b }}
	frameChunks = sync.Pool{New: func() any { b := make([]byte, 0, MaxFrameSize); return &b }}
)

func getChunk(n int) *[]byte {
	if n <= smallChunkSize {
		return smallChunks.Get().(*[]byte)
	}
	return frameChunks.Get().(*[]byte)
}

func putChunk(b *[]byte) {
	switch cap(*b) {
	case smallChunkSize:
		smallChunks.Put(b)
	case MaxFrameSize:
		frameChunks.Put(b)
	}
}

func hf(name, value string) hpack.HeaderField { return hpack.HeaderField{Name: name, Value: value} }

func noop() {}
