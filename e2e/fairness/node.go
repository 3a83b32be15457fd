package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The node namespace's helpers run as this program again, inside the
// namespace (ip netns exec), with nodeEnv saying which: "backends" (the
// zero-byte source and the echo backend) or "relay=<delay>" (the delaying
// HTTP CONNECT relay). They serve until SIGTERM or the benchmark dies
// (Pdeathsig).
const nodeEnv = "KFAIR_NODE"

// Addresses inside the node namespace.
const (
	sourceAddr = "127.0.0.1:9001" // writes zeros until the tunnel closes
	echoAddr   = "127.0.0.1:9002" // echoes what it reads
	relayAddr  = "127.0.0.1:3128" // the delaying HTTP CONNECT relay
)

func runNode(role string) int {
	var err error
	switch {
	case role == "backends":
		err = serveBackends()
	case strings.HasPrefix(role, "relay="):
		var d time.Duration
		if d, err = time.ParseDuration(strings.TrimPrefix(role, "relay=")); err == nil {
			err = serveRelay(relayAddr, d)
		}
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "node %s: %v\n", role, err)
		return 1
	}
	return 0
}

// serveUntilSignal accepts on ln, running serve for each connection on a
// goroutine of its own, until SIGTERM; then it closes ln and every
// connection it still serves.
func serveUntilSignal(lns []net.Listener, serves []func(net.Conn)) error {
	var mu sync.Mutex
	open := map[net.Conn]struct{}{}
	var wg sync.WaitGroup
	for i, ln := range lns {
		serve := serves[i]
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				mu.Lock()
				open[c] = struct{}{}
				mu.Unlock()
				wg.Add(1)
				go func() {
					defer wg.Done()
					serve(c)
					c.Close()
					mu.Lock()
					delete(open, c)
					mu.Unlock()
				}()
			}
		}()
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	<-sig
	for _, ln := range lns {
		ln.Close()
	}
	mu.Lock()
	for c := range open {
		c.Close()
	}
	mu.Unlock()
	wg.Wait()
	return nil
}

func serveBackends() error {
	src, err := net.Listen("tcp", sourceAddr)
	if err != nil {
		return err
	}
	echo, err := net.Listen("tcp", echoAddr)
	if err != nil {
		return err
	}
	zeros := make([]byte, 128<<10)
	return serveUntilSignal([]net.Listener{src, echo}, []func(net.Conn){
		func(c net.Conn) {
			// The client speaks first (a byte), as the benchmarks'
			// destinations do; then zeros until the tunnel closes.
			var b [1]byte
			if _, err := io.ReadFull(c, b[:]); err != nil {
				return
			}
			go func() { io.Copy(io.Discard, c); c.Close() }() // the client's close ends the source
			for {
				if _, err := c.Write(zeros); err != nil {
					return
				}
			}
		},
		func(c net.Conn) {
			if tc, ok := c.(*net.TCPConn); ok {
				tc.SetNoDelay(true)
			}
			io.Copy(c, c)
		},
	})
}

// serveRelay is an HTTP CONNECT proxy that holds every byte for delay in
// each direction and limits nothing else: what it has read it writes
// delay later, as fast as the far side takes it. What it holds is bounded
// (relayChunks chunks in flight per direction), far above a link's needs.
func serveRelay(addr string, delay time.Duration) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	return serveUntilSignal([]net.Listener{ln}, []func(net.Conn){func(c net.Conn) { relayConn(c, delay) }})
}

// relayChunks bounds the chunks one direction of the relay holds: with
// relayChunk-sized reads, 64 MiB, a 25 ms hold at 2.5 GB/s.
const (
	relayChunks = 2048
	relayChunk  = 32 << 10
)

func relayConn(c net.Conn, delay time.Duration) {
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil || req.Method != http.MethodConnect {
		io.WriteString(c, "HTTP/1.1 400 Bad Request\r\n\r\n")
		return
	}
	far, err := net.DialTimeout("tcp", req.Host, 10*time.Second)
	if err != nil {
		io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\n\r\n")
		return
	}
	defer far.Close()
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection Established\r\n\r\n"); err != nil {
		return
	}
	done := make(chan struct{}, 2)
	go func() { delayCopy(far, br, delay); done <- struct{}{} }()
	go func() { delayCopy(c, far, delay); done <- struct{}{} }()
	<-done // either side ended: end both
	c.Close()
	far.Close()
	<-done
}

// heldChunk is bytes read at a time, written delay after it.
type heldChunk struct {
	b  []byte
	at time.Time
}

// delayCopy copies src to dst, each byte written delay after it was read.
// A failed write ends it at once; the reader ends when src is closed.
func delayCopy(dst io.Writer, src io.Reader, delay time.Duration) {
	q := make(chan heldChunk, relayChunks)
	free := make(chan []byte, relayChunks)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		defer close(q)
		for {
			var b []byte
			select {
			case b = <-free:
			default:
				b = make([]byte, relayChunk)
			}
			n, err := src.Read(b[:relayChunk])
			if n > 0 {
				select {
				case q <- heldChunk{b: b[:n], at: time.Now().Add(delay)}:
				case <-stop:
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	for h := range q {
		if d := time.Until(h.at); d > 0 {
			time.Sleep(d)
		}
		if _, err := dst.Write(h.b); err != nil {
			return
		}
		select {
		case free <- h.b[:cap(h.b)]:
		default:
		}
	}
	if cw, ok := dst.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite()
	}
}
