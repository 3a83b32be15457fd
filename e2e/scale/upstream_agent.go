package main

import (
	"context"
	"crypto/tls"
	"errors"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	proxypb "sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"
)

// Retry pacing of the upstream-protocol agents: upstream's proxy-agent
// defaults (--sync-interval 1s, --sync-interval-cap 10s), doubled per
// failure, with jitter.
const (
	upstreamRetry    = time.Second
	upstreamRetryCap = 10 * time.Second
	upstreamSetup    = 15 * time.Second // connection and stream set-up bound
	upstreamDestIdle = 5 * time.Second  // bound on one write to a destination
)

// upstreamAgent speaks upstream's agent protocol as a simulated agent:
// one gRPC connection (its own TLS connection) and one
// /AgentService/Connect call, with grpc-go and konnectivity-client's packet
// types. It is the benchmark's own code, not upstream's agent: it serves
// what the server's side of the protocol needs (DIAL_REQ, DATA, CLOSE_REQ)
// and retries as upstream's defaults pace it. Its endpoints are its open
// tunnels, by connect ID.
type upstreamAgent struct {
	f    *fleet
	id   string
	tls  *tls.Config
	up   atomic.Bool   // holds a stream the server accepted
	fail atomic.Uint64 // attempts that did not get a stream

	mu        sync.Mutex // guards endpoints, nextID and serving
	endpoints map[int64]net.Conn
	nextID    int64
	serving   bool // a stream is being served: a dial may add its endpoint
}

func newUpstreamAgent(f *fleet, i int) (simAgent, error) {
	c := f.tls.Clone()
	host, _, err := net.SplitHostPort(f.args.Server)
	if err != nil {
		return nil, err
	}
	c.ServerName = host
	return &upstreamAgent{f: f, id: "scale-" + strconv.Itoa(i), tls: c, endpoints: map[int64]net.Conn{}}, nil
}

func (a *upstreamAgent) connected() bool  { return a.up.Load() }
func (a *upstreamAgent) failures() uint64 { return a.fail.Load() }

func (a *upstreamAgent) open() int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return int64(len(a.endpoints))
}

// run keeps the agent connected until ctx ends.
func (a *upstreamAgent) run(ctx context.Context) {
	delay := upstreamRetry
	for ctx.Err() == nil {
		served, err := a.session(ctx)
		if ctx.Err() != nil {
			return
		}
		if served {
			delay = upstreamRetry
		} else {
			a.fail.Add(1)
			a.f.errs.note(err.Error())
		}
		// Jitter: between half and all of the delay.
		d := delay/2 + rand.N(delay/2+1)
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		if !served {
			delay = min(2*delay, upstreamRetryCap)
		}
	}
}

// session opens one connection and stream and serves it until it ends;
// served says whether the server accepted it.
func (a *upstreamAgent) session(ctx context.Context) (served bool, err error) {
	cc, err := grpc.NewClient(a.f.args.Server, grpc.WithTransportCredentials(credentials.NewTLS(a.tls)))
	if err != nil {
		return false, err
	}
	defer cc.Close()
	sctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(ctx, "agentid", a.id, "agentidentifiers", ""))
	defer cancel()
	setup := time.AfterFunc(upstreamSetup, cancel)
	st, err := cc.NewStream(sctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, "/AgentService/Connect")
	if err == nil {
		var h metadata.MD
		if h, err = st.Header(); err == nil && len(h.Get("serverid")) == 0 {
			// A refusal is a trailers-only answer: its status comes with
			// the first receive.
			err = st.RecvMsg(&proxypb.Packet{})
			if err == nil {
				err = errors.New("no serverid header")
			}
		}
	}
	if !setup.Stop() && err == nil {
		err = errors.New("set-up timed out")
	}
	if err != nil {
		return false, err
	}
	a.up.Store(true)
	a.f.connectedNow()
	a.serve(sctx, st)
	a.up.Store(false)
	return true, nil
}

// serve handles the server's packets until the stream ends, then closes
// every endpoint and waits for their readers.
func (a *upstreamAgent) serve(ctx context.Context, st grpc.ClientStream) {
	var (
		wg     sync.WaitGroup
		sendMu sync.Mutex // grpc-go allows one SendMsg at a time
	)
	send := func(p *proxypb.Packet) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return st.SendMsg(p)
	}
	closeRsp := func(id int64, e string) *proxypb.Packet {
		return &proxypb.Packet{Type: proxypb.PacketType_CLOSE_RSP, Payload: &proxypb.Packet_CloseResponse{
			CloseResponse: &proxypb.CloseResponse{ConnectID: id, Error: e}}}
	}
	a.mu.Lock()
	a.serving = true
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		a.serving = false
		eps := a.endpoints
		a.endpoints = map[int64]net.Conn{}
		a.mu.Unlock()
		for _, c := range eps {
			c.Close()
		}
		wg.Wait()
	}()
	for {
		p := &proxypb.Packet{}
		if err := st.RecvMsg(p); err != nil {
			return
		}
		switch p.GetType() {
		case proxypb.PacketType_DIAL_REQ:
			req := p.GetDialRequest()
			wg.Add(1)
			go func() { // owned by serve: waited for when it returns
				defer wg.Done()
				a.dial(ctx, req.GetAddress(), req.GetRandom(), send, closeRsp)
			}()
		case proxypb.PacketType_DATA:
			d := p.GetData()
			a.mu.Lock()
			c := a.endpoints[d.GetConnectID()]
			a.mu.Unlock()
			if c == nil {
				_ = send(closeRsp(d.GetConnectID(), "unrecognized connectID"))
				continue
			}
			// Written here, in order: the destinations are local echo
			// servers, and a stuck one is cut off after upstreamDestIdle.
			_ = c.SetWriteDeadline(time.Now().Add(upstreamDestIdle))
			if _, err := c.Write(d.GetData()); err != nil {
				c.Close()
			}
		case proxypb.PacketType_CLOSE_REQ:
			id := p.GetCloseRequest().GetConnectID()
			a.mu.Lock()
			c := a.endpoints[id]
			delete(a.endpoints, id)
			a.mu.Unlock()
			if c != nil {
				c.Close()
			}
			_ = send(closeRsp(id, ""))
		}
	}
}

// dial opens a destination, answers DIAL_RSP and copies the destination's
// bytes to the server until it ends, then reports the end (CLOSE_RSP).
func (a *upstreamAgent) dial(ctx context.Context, addr string, random int64, send func(*proxypb.Packet) error, closeRsp func(int64, string) *proxypb.Packet) {
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	var d net.Dialer
	c, err := d.DialContext(dctx, "tcp", addr)
	cancel()
	if err != nil {
		_ = send(&proxypb.Packet{Type: proxypb.PacketType_DIAL_RSP, Payload: &proxypb.Packet_DialResponse{
			DialResponse: &proxypb.DialResponse{Random: random, Error: err.Error()}}})
		return
	}
	a.mu.Lock()
	if !a.serving { // the stream ended while this dial was under way
		a.mu.Unlock()
		c.Close()
		return
	}
	a.nextID++
	id := a.nextID
	a.endpoints[id] = c // before DIAL_RSP: DATA may follow it at once
	a.mu.Unlock()
	if err := send(&proxypb.Packet{Type: proxypb.PacketType_DIAL_RSP, Payload: &proxypb.Packet_DialResponse{
		DialResponse: &proxypb.DialResponse{Random: random, ConnectID: id}}}); err != nil {
		a.mu.Lock()
		delete(a.endpoints, id)
		a.mu.Unlock()
		c.Close()
		return
	}
	buf := make([]byte, 4<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if send(&proxypb.Packet{Type: proxypb.PacketType_DATA, Payload: &proxypb.Packet_Data{
				Data: &proxypb.Data{ConnectID: id, Data: buf[:n]}}}) != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	c.Close()
	a.mu.Lock()
	_, mine := a.endpoints[id]
	delete(a.endpoints, id)
	a.mu.Unlock()
	if mine { // the destination ended, not a CLOSE_REQ
		_ = send(closeRsp(id, ""))
	}
}
