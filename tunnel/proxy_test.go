package tunnel

import (
	"io"
	"net"
	"sync"
	"testing"
)

// testLB is a round-robin TCP load balancer on loopback. It can also
// blackhole: stop forwarding on every open connection without closing any,
// as a dead network path looks.
type testLB struct {
	ln net.Listener

	mu       sync.Mutex
	backends []string
	next     int
	conns    map[net.Conn]bool
	frozen   bool
	thaw     chan struct{}

	wg sync.WaitGroup
}

func newTestLB(t testing.TB, backends ...string) *testLB {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lb := &testLB{ln: ln, backends: backends, conns: map[net.Conn]bool{}, thaw: make(chan struct{})}
	lb.wg.Add(1)
	go lb.serve()
	t.Cleanup(lb.close)
	return lb
}

func (lb *testLB) addr() string { return lb.ln.Addr().String() }

func (lb *testLB) setBackends(b ...string) {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	lb.backends = b
}

func (lb *testLB) serve() {
	defer lb.wg.Done()
	for {
		c, err := lb.ln.Accept()
		if err != nil {
			return
		}
		lb.mu.Lock()
		backend := ""
		if len(lb.backends) > 0 {
			backend = lb.backends[lb.next%len(lb.backends)]
			lb.next++
		}
		lb.mu.Unlock()
		if backend == "" {
			c.Close()
			continue
		}
		up, err := net.Dial("tcp", backend)
		if err != nil {
			c.Close()
			continue
		}
		lb.track(c, up)
		lb.wg.Add(2)
		go lb.pipe(up, c)
		go lb.pipe(c, up)
	}
}

func (lb *testLB) track(cs ...net.Conn) {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	for _, c := range cs {
		lb.conns[c] = true
	}
}

// pipe copies src to dst, pausing (without closing anything) while frozen.
func (lb *testLB) pipe(dst, src net.Conn) {
	defer lb.wg.Done()
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		lb.mu.Lock()
		frozen, thaw := lb.frozen, lb.thaw
		lb.mu.Unlock()
		if frozen {
			<-thaw // drop nothing, forward nothing, until closed
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err == io.EOF {
				if cw, ok := dst.(interface{ CloseWrite() error }); ok {
					cw.CloseWrite()
				}
			}
			return
		}
	}
}

// blackhole stops forwarding on all connections, open and new.
func (lb *testLB) blackhole() {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	lb.frozen = true
}

func (lb *testLB) close() {
	lb.ln.Close()
	lb.mu.Lock()
	if lb.frozen {
		close(lb.thaw)
		lb.frozen = false
	}
	for c := range lb.conns {
		c.Close()
	}
	lb.mu.Unlock()
	lb.wg.Wait()
}
