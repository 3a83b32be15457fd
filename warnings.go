package main

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"sync"
)

// warnedState names, in the state a restart hands over (Work.State), the
// one-time warnings the process has logged.
const warnedState = "warned"

// onceWarnings are the warnings a daemon logs once in its process's
// lifetime: at start (flags read differently from upstream, ignored
// arguments) and on first occurrence (identity binding off). A
// self-restart hands the keys of those logged to the next image, which
// logs only the others, so a SIGHUP never repeats them. The start
// warnings wait (delay) until the process knows what its previous image
// logged (start). Safe for concurrent use.
type onceWarnings struct {
	mu      sync.Mutex
	warned  map[string]bool // keys logged in this process's lifetime; guarded by mu
	delayed []startWarning  // start warnings until start; guarded by mu
}

func newOnceWarnings() *onceWarnings {
	return &onceWarnings{warned: map[string]bool{}}
}

// delay saves start warnings until start.
func (w *onceWarnings) delay(ws []startWarning) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.delayed = append(w.delayed, ws...)
}

// start takes the keys a previous image handed over (data, from
// daemon.InheritedState; nil on a first start) and logs the delayed
// start warnings not among them.
func (w *onceWarnings) start(data json.RawMessage, log *slog.Logger) {
	var inherited []string
	if data != nil {
		if err := json.Unmarshal(data, &inherited); err != nil {
			log.Warn("one-time warnings of the previous image unreadable; they may repeat", "err", err)
		}
	}
	w.mu.Lock()
	for _, k := range inherited {
		w.warned[k] = true
	}
	delayed := w.delayed
	w.delayed = nil
	w.mu.Unlock()
	for _, sw := range delayed {
		if w.first(sw.key()) {
			log.Warn(sw.msg, sw.args...)
		}
	}
}

// first records key and reports whether it is the first time in the
// process's lifetime: the caller logs the warning then.
func (w *onceWarnings) first(key string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.warned[key] {
		return false
	}
	w.warned[key] = true
	return true
}

// handed is what a restart hands the next image.
func (w *onceWarnings) handed() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	keys := make([]string, 0, len(w.warned))
	for k := range w.warned {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// key names a start warning by its message and values.
func (sw startWarning) key() string {
	return sw.msg + " " + fmt.Sprint(sw.args...)
}
