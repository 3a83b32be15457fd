package tunnel

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// logLimiter lets one line per key through per interval and counts the
// rest, so a reconnect storm or a flood of bad handshakes yields a few
// lines with counts, not one line each.
type logLimiter struct {
	every time.Duration
	mu    sync.Mutex
	keys  map[string]*limitEntry
}

type limitEntry struct {
	last       time.Time
	suppressed int
}

const maxLimitKeys = 1024

func newLogLimiter(every time.Duration) *logLimiter {
	return &logLimiter{every: every, keys: map[string]*limitEntry{}}
}

// allow reports whether a line for key may be logged now, and how many
// were suppressed since the last one.
func (l *logLimiter) allow(key string) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	e := l.keys[key]
	if e == nil {
		if len(l.keys) >= maxLimitKeys {
			for k, old := range l.keys { // forget quiet keys first
				if now.Sub(old.last) > l.every {
					delete(l.keys, k)
				}
			}
			if len(l.keys) >= maxLimitKeys {
				return false, 0
			}
		}
		l.keys[key] = &limitEntry{last: now}
		return true, 0
	}
	if now.Sub(e.last) < l.every {
		e.suppressed++
		return false, 0
	}
	n := e.suppressed
	e.last, e.suppressed = now, 0
	return true, n
}

// log writes the line if the key allows it, adding the suppressed count.
func (l *logLimiter) log(logger *slog.Logger, level slog.Level, key, msg string, args ...any) {
	ok, suppressed := l.allow(key)
	if !ok {
		return
	}
	if suppressed > 0 {
		args = append(args, "suppressed", suppressed)
	}
	logger.Log(context.Background(), level, msg, args...)
}
