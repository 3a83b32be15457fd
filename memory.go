package main

import (
	"bufio"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// releaseStartupPages asks the kernel to drop this process's resident
// pages of its own executable once start-up is over. Start-up (runtime and
// package initialisation, flag parsing, TLS set-up) touches most of the
// binary; a long-running daemon then uses a small part of it. The pages
// stay in the page cache and come back on first use, so this only lowers
// the resident set (and the memory charged to the service's cgroup) by the
// code that is not running. Best effort: errors are logged at debug level.
func releaseStartupPages(log *slog.Logger) {
	exe, err := os.Executable()
	if err != nil {
		return
	}
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return
	}
	defer f.Close()
	released := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// address perms offset dev inode path
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 || strings.TrimSuffix(strings.Join(fields[5:], " "), " (deleted)") != exe {
			continue
		}
		if strings.Contains(fields[1], "w") {
			continue // data and bss are private, written memory: not ours to drop
		}
		var start, end uintptr
		if _, err := fmt.Sscanf(fields[0], "%x-%x", &start, &end); err != nil || end <= start {
			continue
		}
		// A raw madvise: the range is a mapping of the executable, not Go memory.
		if _, _, errno := unix.Syscall(unix.SYS_MADVISE, start, end-start, unix.MADV_PAGEOUT); errno != 0 {
			log.Debug("release start-up pages", "err", errno)
			return
		}
		released += int(end - start)
	}
	log.Debug("released start-up pages of the executable", "mapped_bytes", released)
}
