package h2link

import (
	"net"
	"testing"

	"github.com/spinifex/konnectivity/internal/testnet"
)

// connPair listens on network and address, dials it and returns both ends
// (the dialled one first); the caller closes them.
func connPair(t testing.TB, network, address string) (near, far net.Conn) {
	t.Helper()
	ln, err := net.Listen(network, address)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	near, err = net.Dial(network, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	far = <-accepted
	if far == nil {
		near.Close()
		t.Fatal("accept failed")
	}
	return near, far
}

func checkNoLeaks(t *testing.T) { testnet.CheckNoLeaks(t) }

func onlyOurs(stacks string) string { return testnet.OnlyOurs(stacks) }
