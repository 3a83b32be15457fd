package server

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/spinifex/konnectivity/tunnel/internal/tunneltest"
	"github.com/spinifex/konnectivity/tunnel/wire"

	"golang.org/x/net/http2"
)

// A peer of the gRPC front door that floods PINGs and never reads is
// dropped once the link's control queue is full (ENHANCE_YOUR_CALM); the
// heap growth is logged.
func TestGRPCFrontDoorPingFloodDropped(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	e := newEnv(t, nil)
	defer e.Stop()
	sock := e.grpcSocket(t)
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	fr := http2.NewFramer(c, c)
	c.Write([]byte(http2.ClientPreface))
	fr.WriteSettings()
	watchdog := time.AfterFunc(30*time.Second, func() { c.Close() })
	defer watchdog.Stop()
	var n int
	for ; fr.WritePing(false, [8]byte{byte(n)}) == nil; n++ {
	}
	if !watchdog.Stop() {
		t.Fatalf("the front door still read PINGs after 30 s (%d sent, none read back)", n)
	}
	grown := int64(heap()) - int64(before)
	t.Logf("dropped after %d PINGs; heap %+d KiB", n, grown>>10)
}

// An agent facing a hostile server (its TLS and handshake pass) that
// floods PINGs and never reads drops that connection once its link's
// control queue is full, instead of queueing answers without bound.
func TestAgentDropsPingFloodingServer(t *testing.T) {
	tunneltest.CheckNoLeaks(t)
	p := tunneltest.NewPKI(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	result := make(chan string, 1)
	go func() {
		raw, err := ln.Accept()
		if err != nil {
			result <- "accept: " + err.Error()
			return
		}
		defer raw.Close()
		c := tls.Server(raw, &tls.Config{Certificates: []tls.Certificate{p.ServerCert}})
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			result <- "handshake: " + err.Error()
			return
		}
		if _, err := c.Write(wire.Switching("evil", 1)); err != nil {
			result <- "101 not written"
			return
		}
		c.Write([]byte(http2.ClientPreface))
		fr := http2.NewFramer(c, c)
		fr.WriteSettings()
		var stacks string
		watchdog := time.AfterFunc(60*time.Second, func() {
			buf := make([]byte, 1<<20)
			stacks = tunneltest.OnlyOurs(string(buf[:runtime.Stack(buf, true)]))
			raw.Close()
		})
		defer watchdog.Stop()
		n := 0
		for ; fr.WritePing(false, [8]byte{byte(n)}) == nil; n++ {
		}
		if !watchdog.Stop() {
			result <- fmt.Sprintf("the agent still read PINGs after 60 s (%d sent, none read back)\n%s", n, stacks)
			return
		}
		result <- fmt.Sprintf("ok: dropped after %d PINGs", n)
	}()
	a := startAgentTo(t, p, []string{ln.Addr().String()}, "a1", "", nil)
	defer a.Stop()
	r := <-result
	if !strings.HasPrefix(r, "ok") {
		t.Fatal(r)
	}
	t.Log(r)
}
