package e2e

import (
	"bufio"
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestProbeGC(t *testing.T) {
	dir := t.TempDir()
	bin := copyExecutable(t, dir)
	s := startServerBinEnv(t, bin, []string{"GOGC=1"}, frontendUDS, "--restart-grace=2s")
	s.startAgent(t, "a1", "", "--sync-interval=100ms")
	echo := startTCPBackend(t, "127.0.0.1", echoHandler)
	d := s.egressDialer(t).bounded()
	ino := inode(t, s.sock)
	for i := 0; i < 3; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, err := d(ctx, "tcp", echo.addr())
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(c)
		s.proc.signal(t, syscall.SIGHUP)
		end := time.Now().Add(500 * time.Millisecond)
		for time.Now().Before(end) {
			_ = echoOnce(c, br, "x\n")
		}
		c.Close()
		time.Sleep(3 * time.Second)
		if strings.Count(s.proc.out.String(), "re-executing") != i+1 {
			s.proc.signal(t, syscall.SIGQUIT)
			<-s.proc.done
			t.Fatalf("hung:\n%s", s.proc.out.String())
		}
	}
	out := s.proc.out.String()
	t.Logf("unusable lines: %d; inode %d -> %d", strings.Count(out, "inherited listener unusable"), ino, inode(t, s.sock))
	t.Log(lineWith(out, "unusable"))
	fmt.Sprint()
}
