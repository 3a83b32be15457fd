package wire

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// LogLimiter lets one line per key through per interval and counts the
// rest, so a reconnect storm or a flood of bad handshakes yields a few
// lines with counts, not one line each.
type LogLimiter struct {
	every time.Duration
	mu    sync.Mutex
	Keys  map[string]*limitEntry
}

type limitEntry struct {
	Last       time.Time
	suppressed int
}

const maxLimitKeys = 1024

func NewLogLimiter(every time.Duration) *LogLimiter {
	return &LogLimiter{every: every, Keys: map[string]*limitEntry{}}
}

// Allow reports whether a line for key may be logged now, and how many
// were suppressed since the last one.
func (l *LogLimiter) Allow(key string) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	e := l.Keys[key]
	if e == nil {
		if len(l.Keys) >= maxLimitKeys {
			for k, old := range l.Keys { // forget quiet keys first
				if now.Sub(old.Last) > l.every {
					delete(l.Keys, k)
				}
			}
			if len(l.Keys) >= maxLimitKeys {
				return false, 0
			}
		}
		l.Keys[key] = &limitEntry{Last: now}
		return true, 0
	}
	if now.Sub(e.Last) < l.every {
		e.suppressed++
		return false, 0
	}
	n := e.suppressed
	e.Last, e.suppressed = now, 0
	return true, n
}

// Log writes the line if the key allows it, adding the suppressed count.
func (l *LogLimiter) Log(logger *slog.Logger, level slog.Level, key, msg string, args ...any) {
	ok, suppressed := l.Allow(key)
	if !ok {
		return
	}
	if suppressed > 0 {
		args = append(args, "suppressed", suppressed)
	}
	logger.Log(context.Background(), level, msg, args...)
}
