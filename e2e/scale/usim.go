package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
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
	usimRetry    = time.Second
	usimRetryCap = 10 * time.Second
	usimSetup    = 15 * time.Second // connection and stream set-up bound
	usimDestIdle = 5 * time.Second  // bound on one write to a destination
)

// usim runs agents that speak upstream's agent protocol, in this process:
// one gRPC connection (its own TLS connection) and one
// /AgentService/Connect call per agent, with grpc-go and
// konnectivity-client's packet types. It is the benchmark's own code, not
// upstream's agent: it serves what the server's side of the protocol
// needs (DIAL_REQ, DATA, CLOSE_REQ, DIAL_CLS) and retries as upstream's
// defaults pace it. Requests as for sim.
type usim struct {
	args simArgs
	tls  *tls.Config
	ctx  context.Context
	wg   sync.WaitGroup // one per running agent

	mu     sync.Mutex // guards agents
	agents []*uAgent

	connects    atomic.Int64
	lastConnect atomic.Int64 // unix nanoseconds
	errMu       sync.Mutex   // guards errSeen
	errSeen     map[string]int
}

// uAgent is one upstream-protocol agent; its endpoints are its open
// tunnels, by connect ID.
type uAgent struct {
	s        *usim
	id       string
	up       atomic.Bool   // holds a stream the server accepted
	failures atomic.Uint64 // attempts that did not get a stream

	mu        sync.Mutex // guards endpoints, nextID and serving
	endpoints map[int64]net.Conn
	nextID    int64
	serving   bool // a stream is being served: a dial may add its endpoint
}

func runUsim(in io.Reader, out io.Writer) error {
	var args simArgs
	if err := json.Unmarshal([]byte(os.Getenv(helperArgsEnv)), &args); err != nil {
		return fmt.Errorf("settings: %w", err)
	}
	caPEM, err := os.ReadFile(args.CACert)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("%s: no certificate", args.CACert)
	}
	cert, err := tls.LoadX509KeyPair(args.AgentCert, args.AgentKey)
	if err != nil {
		return err
	}
	host, _, _ := net.SplitHostPort(args.Server)
	ctx, cancel := context.WithCancel(context.Background())
	s := &usim{
		args:    args,
		tls:     &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}, ServerName: host, MinVersion: tls.VersionTLS12},
		ctx:     ctx,
		errSeen: map[string]int{},
	}
	defer func() {
		cancel()
		s.wg.Wait()
	}()
	fmt.Fprintln(out, "ready")
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		var ans string
		switch f[0] {
		case "start":
			ans = s.start(f[1:])
		case "stat":
			ans = s.statLine()
		default:
			ans = "error unknown request " + strconv.Quote(f[0])
		}
		fmt.Fprintln(out, ans)
	}
	return nil
}

func (s *usim) start(f []string) string {
	if len(f) != 2 {
		return "error want: start FROM TO"
	}
	from, err1 := strconv.Atoi(f[0])
	to, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil || from < 0 || to < from {
		return "error bad range"
	}
	for i := from; i < to; i++ {
		a := &uAgent{s: s, id: "scale-" + strconv.Itoa(i), endpoints: map[int64]net.Conn{}}
		s.mu.Lock()
		s.agents = append(s.agents, a)
		s.mu.Unlock()
		s.wg.Add(1)
		go func() { // owned by s: ends when s.ctx ends
			defer s.wg.Done()
			a.run(s.ctx)
		}()
	}
	return "ok"
}

func (s *usim) statLine() string {
	s.mu.Lock()
	agents := s.agents
	s.mu.Unlock()
	var connected, open int64
	var failures, maxFail, retried2 uint64
	for _, a := range agents {
		if a.up.Load() {
			connected++
		}
		a.mu.Lock()
		open += int64(len(a.endpoints))
		a.mu.Unlock()
		n := a.failures.Load()
		failures += n
		maxFail = max(maxFail, n)
		if n >= 2 {
			retried2++
		}
	}
	rss, _ := rssKiB(os.Getpid())
	return fmt.Sprintf("stat agents=%d connected=%d connects=%d last_connect=%d failures=%d max_failures=%d retried2=%d open=%d goroutines=%d rss_kib=%d errors=%s",
		len(agents), connected, s.connects.Load(), s.lastConnect.Load(), failures, maxFail, retried2, open,
		runtime.NumGoroutine(), rss, s.errSummary())
}

func (s *usim) noteErr(err error) {
	e := shortErr(err.Error())
	s.errMu.Lock()
	defer s.errMu.Unlock()
	if len(s.errSeen) < 32 || s.errSeen[e] > 0 {
		s.errSeen[e]++
	}
}

func (s *usim) errSummary() string {
	s.errMu.Lock()
	defer s.errMu.Unlock()
	best, n := "", 0
	for e, c := range s.errSeen {
		if c > n {
			best, n = e, c
		}
	}
	if best == "" {
		return "-"
	}
	return strconv.Itoa(n) + "x:" + strings.ReplaceAll(best, " ", "_")
}

// run keeps the agent connected until ctx ends.
func (a *uAgent) run(ctx context.Context) {
	delay := usimRetry
	for ctx.Err() == nil {
		served, err := a.session(ctx)
		if ctx.Err() != nil {
			return
		}
		if served {
			delay = usimRetry
		} else {
			a.failures.Add(1)
			a.s.noteErr(err)
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
			delay = min(2*delay, usimRetryCap)
		}
	}
}

// session opens one connection and stream and serves it until it ends;
// served says whether the server accepted it.
func (a *uAgent) session(ctx context.Context) (served bool, err error) {
	cc, err := grpc.NewClient(a.s.args.Server, grpc.WithTransportCredentials(credentials.NewTLS(a.s.tls)))
	if err != nil {
		return false, err
	}
	defer cc.Close()
	sctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(ctx, "agentid", a.id, "agentidentifiers", ""))
	defer cancel()
	setup := time.AfterFunc(usimSetup, cancel)
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
	a.s.connects.Add(1)
	a.s.lastConnect.Store(time.Now().UnixNano())
	a.serve(sctx, st)
	a.up.Store(false)
	return true, nil
}

// serve handles the server's packets until the stream ends, then closes
// every endpoint and waits for their readers.
func (a *uAgent) serve(ctx context.Context, st grpc.ClientStream) {
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
			// servers, and a stuck one is cut off after usimDestIdle.
			_ = c.SetWriteDeadline(time.Now().Add(usimDestIdle))
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
func (a *uAgent) dial(ctx context.Context, addr string, random int64, send func(*proxypb.Packet) error, closeRsp func(int64, string) *proxypb.Packet) {
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
