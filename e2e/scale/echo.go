package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"

	"github.com/spinifex/konnectivity/e2e/internal/benchproc"
)

// echoArgs are an echo destination's settings.
type echoArgs struct {
	Bind string `json:"bind"` // loopback address to listen on, port 0
}

// echoBuf is small: held tunnels are idle, and the destination's memory is
// not what is measured.
const echoBuf = 1 << 10

// runEcho serves echo on a loopback address, answers "ready ADDR", then
// "stat conns=N goroutines=N rss_kib=N" per "stat" request, and stops when
// its stdin closes, closing every connection.
func runEcho(in io.Reader, out io.Writer) error {
	var args echoArgs
	if err := json.Unmarshal([]byte(os.Getenv(helperArgsEnv)), &args); err != nil {
		return fmt.Errorf("settings: %w", err)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(args.Bind, "0"))
	if err != nil {
		return err
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex // guards conns
		conns = map[net.Conn]struct{}{}
	)
	wg.Add(1)
	go func() { // accept loop, owned by runEcho: ends when ln closes
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = struct{}{}
			mu.Unlock()
			wg.Add(1)
			go func() { // owned by runEcho: ends when c closes
				defer wg.Done()
				buf := make([]byte, echoBuf)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						if _, werr := c.Write(buf[:n]); werr != nil {
							break
						}
					}
					if err != nil {
						break
					}
				}
				c.Close()
				mu.Lock()
				delete(conns, c)
				mu.Unlock()
			}()
		}
	}()
	fmt.Fprintln(out, "ready", ln.Addr().String())
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		switch strings.TrimSpace(sc.Text()) {
		case "stat":
			mu.Lock()
			n := len(conns)
			mu.Unlock()
			rss, _ := benchproc.RSSKiB(os.Getpid())
			fmt.Fprintf(out, "stat conns=%d goroutines=%d rss_kib=%d\n", n, runtime.NumGoroutine(), rss)
		case "gc":
			runtime.GC()
			fmt.Fprintln(out, "ok")
		default:
			fmt.Fprintln(out, "error unknown request")
		}
	}
	ln.Close()
	mu.Lock()
	for c := range conns {
		c.Close()
	}
	mu.Unlock()
	wg.Wait()
	return nil
}
