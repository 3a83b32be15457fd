package h2link

import (
	"crypto/tls"
	"net"
	"sync"
	"time"
)

// Batcher sits under TLS (or wraps a plain socket) and, while a write is in
// progress above it, gathers what is written so it leaves in one system
// call: a 64 KiB DATA frame is five TLS records, and a write per record was
// the largest single cost on the byte path. The batch buffer comes from a
// pool and goes back after each write, so an idle connection holds none.
type Batcher struct {
	net.Conn

	mu    sync.Mutex    // guards depth, buf and spent; taken while a batch is written, so a concurrent writer cannot overtake it
	depth int           // nested begin calls not yet ended
	buf   *[]byte       // nil outside a batch
	spent time.Duration // the time the current or last batch's system calls took: the link's part of a write
}

// NewBatcher wraps c; writes pass straight through outside a batch.
func NewBatcher(c net.Conn) *Batcher { return &Batcher{Conn: c} }

// batchBufs is immutable after init (a sync.Pool is safe for concurrent use).
var batchBufs = sync.Pool{New: func() any { b := make([]byte, 0, batchFlushAt+tlsRecordMax); return &b }}

// batchFlushAt bounds a batch: two whole DATA frames of MaxFrameSize (what
// one large copy buffer holds) with their headers and the TLS overhead of
// their records fit, so they leave in one write.
const (
	batchFlushAt = 2*MaxFrameSize + 4<<10
	tlsRecordMax = 16<<10 + 256 // a record's plaintext limit plus its overhead
)

func (b *Batcher) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.depth == 0 {
		return b.Conn.Write(p)
	}
	if b.buf == nil {
		b.buf = batchBufs.Get().(*[]byte)
	}
	*b.buf = append(*b.buf, p...)
	if len(*b.buf) >= batchFlushAt { // keep the batch bounded: send it now
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// flushLocked writes the batch and returns its buffer to the pool.
func (b *Batcher) flushLocked() error {
	if b.buf == nil {
		return nil
	}
	var err error
	if len(*b.buf) > 0 {
		start := time.Now()
		_, err = b.Conn.Write(*b.buf)
		b.spent += time.Since(start)
	}
	*b.buf = (*b.buf)[:0]
	batchBufs.Put(b.buf)
	b.buf = nil
	return err
}

func (b *Batcher) begin() {
	b.mu.Lock()
	if b.depth == 0 {
		b.spent = 0
	}
	b.depth++
	b.mu.Unlock()
}

// spentWriting is the time the last batch's system calls took.
func (b *Batcher) spentWriting() time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.spent
}

// end sends what was gathered.
func (b *Batcher) end() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.depth--
	if b.depth > 0 {
		return nil
	}
	return b.flushLocked()
}

// BatchedTLS is a TLS connection whose writes go out in one system call.
type BatchedTLS struct {
	*tls.Conn
	raw *Batcher
}

// Batcher is the batcher under the TLS connection, for Config.Batch.
func (c *BatchedTLS) Batcher() *Batcher { return c.raw }

func (c *BatchedTLS) Write(p []byte) (int, error) {
	c.raw.begin()
	n, err := c.Conn.Write(p)
	if ferr := c.raw.end(); err == nil && ferr != nil {
		err = ferr
	}
	return n, err
}

// TLSClient and TLSServer wrap raw in TLS with batched record writes.
func TLSClient(raw net.Conn, cfg *tls.Config) *BatchedTLS {
	b := NewBatcher(raw)
	return &BatchedTLS{Conn: tls.Client(b, cfg), raw: b}
}

func TLSServer(raw net.Conn, cfg *tls.Config) *BatchedTLS {
	b := NewBatcher(raw)
	return &BatchedTLS{Conn: tls.Server(b, cfg), raw: b}
}
