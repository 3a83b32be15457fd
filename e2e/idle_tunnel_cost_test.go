package e2e

import (
	"fmt"
	"testing"
	"time"
)

// maxIdleTunnelKiB bounds the server's RSS per quiet tunnel in
// TestIdleTunnelCost: what a buffer kept per quiet tunnel would cost. The
// figure itself (docs/metrics.md: 16–20 KiB) is printed, not asserted:
// RSS read from outside moves with the machine's load.
const maxIdleTunnelKiB = 32

// TestIdleTunnelCost measures what an open tunnel costs the server while
// nothing moves, from outside the release binary: 1000 tunnels that
// echoed one line, then 1000 whose client never sent a byte after its
// CONNECT: one goroutine on the server for a tunnel that has carried
// bytes, two for one whose client has sent nothing yet (the upload's
// watcher waits for its first byte), and their memory.
func TestIdleTunnelCost(t *testing.T) {
	const n = 1000
	s := startServer(t)
	s.startAgent(t, "a1", "")
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", s.adminPort)
	pid := s.proc.cmd.Process.Pid
	// settled reads the server's RSS and goroutines once the daemon has
	// collected after the burst (every 5 s).
	settled := func() (rssKiB, goroutines int) {
		time.Sleep(6 * time.Second)
		fams, _, err := scrapeRaw(metricsURL)
		if err != nil {
			t.Fatal(err)
		}
		return faultRSSKiB(t, pid), int(fams.value("go_goroutines"))
	}
	open := func(send bool) {
		for i := range n {
			c, br, code, msg, err := faultConnect(s.sock, echo.addr(), 10*time.Second)
			if err != nil || code != 200 {
				t.Fatalf("tunnel %d: %d %s %v", i, code, msg, err)
			}
			t.Cleanup(func() { c.Close() })
			if send {
				if err := echoOnce(c, br, "one line\n"); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	measure := func(what string, send bool, goroutines float64) {
		rss0, g0 := settled()
		open(send)
		rss1, g1 := settled()
		perKiB := float64(rss1-rss0) / n
		perG := float64(g1-g0) / n
		t.Logf("%d tunnels %s: server RSS %+d KiB (%.1f KiB each), goroutines %+d (%.2f each)", n, what, rss1-rss0, perKiB, g1-g0, perG)
		if perG > goroutines+0.05 {
			t.Errorf("%s: %.2f goroutines per tunnel on the server, want %.0f", what, perG, goroutines)
		}
		if perKiB > maxIdleTunnelKiB {
			t.Errorf("%s: %.1f KiB per tunnel on the server, want at most %d (docs/metrics.md: 16–20)", what, perKiB, maxIdleTunnelKiB)
		}
	}
	measure("that echoed a line", true, 1)
	measure("whose client never sent a byte", false, 2)
}
