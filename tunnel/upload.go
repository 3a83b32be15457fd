package tunnel

import (
	"bufio"
	"context"
	"errors"
	"sync"
	"sync/atomic"
)

// upload is the client-to-agent direction of one frontend connection. The
// HTTP/2 transport reads it as the CONNECT request body, but only after the
// agent has answered: until then a watcher merely peeks, so a client that
// gives up during a pending dial cancels it, and a dial retried on another
// agent has lost no byte.
type upload struct {
	br            *bufio.Reader
	unblock       func() // releases a Read blocked on the source
	established   chan struct{}
	isEstablished atomic.Bool
	peeked        chan struct{} // the watcher's Peek returned: data, EOF or error
	clientGoneCtx context.Context
	clientGone    <-chan struct{}
	done          chan struct{} // the upload ended: EOF, error, or the transport let go
	doneOnce      sync.Once
	counters      []*atomic.Int64 // bytes read are added to each
}

var errAbandoned = errors.New("dial attempt abandoned")

// newUpload starts the watcher through spawn, which must run it as an owned
// goroutine; it ends when data arrives or the source is closed. unblock
// must make a Read blocked on br's source return.
func newUpload(br *bufio.Reader, unblock func(), spawn func(func())) *upload {
	ctx, gone := context.WithCancel(context.Background())
	u := &upload{
		br:            br,
		unblock:       unblock,
		established:   make(chan struct{}),
		peeked:        make(chan struct{}),
		clientGoneCtx: ctx,
		clientGone:    ctx.Done(),
		done:          make(chan struct{}),
	}
	spawn(func() {
		_, err := br.Peek(1)
		close(u.peeked)
		if err != nil && !u.isEstablished.Load() {
			gone()
		}
	})
	return u
}

// start lets the transport read: the client has been told 200.
func (u *upload) start() {
	u.isEstablished.Store(true)
	close(u.established)
}

func (u *upload) finish() { u.doneOnce.Do(func() { close(u.done) }) }

// attempt returns the request body for one dial attempt.
func (u *upload) attempt() *uploadBody {
	return &uploadBody{u: u, abandoned: make(chan struct{})}
}

type uploadBody struct {
	u         *upload
	abandoned chan struct{}
	once      sync.Once
}

// abandon ends this attempt's body; it must happen before another attempt
// can be established, so that only one reader ever touches the connection.
func (b *uploadBody) abandon() { b.once.Do(func() { close(b.abandoned) }) }

func (b *uploadBody) isAbandoned() bool {
	select {
	case <-b.abandoned:
		return true
	default:
		return false
	}
}

func (b *uploadBody) Read(p []byte) (int, error) {
	select {
	case <-b.u.established:
	case <-b.abandoned:
		return 0, errAbandoned
	}
	if b.isAbandoned() {
		return 0, errAbandoned
	}
	select {
	case <-b.u.peeked:
	case <-b.abandoned:
		return 0, errAbandoned
	}
	n, err := b.u.br.Read(p)
	for _, c := range b.u.counters {
		c.Add(int64(n))
	}
	if err != nil {
		b.u.finish()
	}
	return n, err
}

// Close is called by the HTTP/2 transport when it is done with the body:
// after EOF, or when the stream ended early. In the second case a Read may
// be blocked on the connection; a past deadline releases it.
func (b *uploadBody) Close() error {
	if b.isAbandoned() || !b.u.isEstablished.Load() {
		b.abandon()
		return nil
	}
	b.abandon()
	b.u.unblock()
	b.u.finish()
	return nil
}
