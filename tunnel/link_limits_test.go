package tunnel

import (
	"net"
	"runtime"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// A peer of the gRPC front door that floods PINGs and never reads is
// dropped once the link's control queue is full (ENHANCE_YOUR_CALM); the
// heap growth is logged.
func TestGRPCFrontDoorPingFloodDropped(t *testing.T) {
	checkNoLeaks(t)
	e := newEnv(t, nil)
	defer e.stop()
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
