package testnet

import (
	"net"
	"sync"
)

// Server runs a handler for each connection its listener accepts.
//
// Lock order: mu is a leaf.
type Server struct {
	ln     net.Listener // read-only after Serve
	handle func(net.Conn)

	mu     sync.Mutex
	conns  map[net.Conn]struct{} // guarded by mu; open connections, nil once closed
	wg     sync.WaitGroup        // the accept goroutine and the handlers
	closed sync.Once
}

// Serve accepts on ln until Close, running handle on its own goroutine for
// each connection and closing the connection when handle returns.
func Serve(ln net.Listener, handle func(net.Conn)) *Server {
	s := &Server{ln: ln, handle: handle, conns: map[net.Conn]struct{}{}}
	s.wg.Add(1)
	go s.accept()
	return s
}

func (s *Server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		if s.conns == nil { // Close came first
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serve(c)
	}
}

func (s *Server) serve(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		if s.conns != nil {
			delete(s.conns, c)
		}
		s.mu.Unlock()
		c.Close()
	}()
	s.handle(c)
}

// Addr is the listener's address as host:port (or the socket path).
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Active is the number of accepted connections whose handler still runs.
func (s *Server) Active() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

// Close stops accepting, closes every open connection and waits until the
// accept goroutine and every handler have returned. Handlers must return
// once their connection is closed. Close may be called more than once.
func (s *Server) Close() {
	s.closed.Do(func() {
		s.ln.Close()
		s.mu.Lock()
		for c := range s.conns {
			c.Close()
		}
		s.conns = nil
		s.mu.Unlock()
	})
	s.wg.Wait()
}
