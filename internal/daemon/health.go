package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"
)

// Check is one named readiness check, reported as "[+]name ok" or
// "[-]name failed: reason" with ?verbose, as Kubernetes components do. Run
// is called from the serving goroutines, so it must be safe for concurrent
// use.
type Check struct {
	Name string
	Run  func() (ok bool, msg string)
}

// healthMux serves /healthz, /livez and /readyz. With readyAll given,
// /readyz?all runs those checks instead (the agent's "every server" view).
func healthMux(ready []Check, readyAll ...Check) *http.ServeMux {
	mux := http.NewServeMux()
	alive := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "ok")
	}
	mux.HandleFunc("/healthz", alive)
	mux.HandleFunc("/livez", alive)
	readyz := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, verbose := r.URL.Query()["verbose"]
		checks := ready
		if _, all := r.URL.Query()["all"]; all && len(readyAll) > 0 {
			checks = readyAll
		}
		status, body := http.StatusOK, ""
		var failed string
		for _, c := range checks {
			ok, msg := c.Run()
			if ok {
				body += fmt.Sprintf("[+]%s ok: %s\n", c.Name, msg)
			} else {
				status = http.StatusServiceUnavailable
				body += fmt.Sprintf("[-]%s failed: %s\n", c.Name, msg)
				failed += fmt.Sprintf("%s: %s\n", c.Name, msg)
			}
		}
		w.WriteHeader(status)
		switch {
		case verbose:
			fmt.Fprint(w, body)
			if status == http.StatusOK {
				fmt.Fprintln(w, "readyz check passed")
			}
		case status == http.StatusOK:
			fmt.Fprint(w, "ok\n")
		default:
			fmt.Fprint(w, failed)
		}
	}
	mux.HandleFunc("/readyz", readyz)
	mux.HandleFunc("/ready", readyz) // upstream's deprecated name
	return mux
}

// httpService is a small HTTP server (health or admin) with its listener.
// Its fields are set by startHTTP and read-only after; the serve goroutine
// it starts is owned by stop, which waits for done.
type httpService struct {
	name string
	ln   net.Listener
	srv  *http.Server
	done chan struct{} // closed when the serve goroutine returns
}

// startHTTP listens on addr (or adopts the inherited listener of that
// name) and serves h until stop. It is called only for a service that is
// on (Daemon.StartServices).
func startHTTP(name string, ls *listenerSet, addr string, h http.Handler, log *slog.Logger) (*httpService, error) {
	ln, err := ls.listen(name, "tcp", addr, func() (net.Listener, error) { return net.Listen("tcp", addr) })
	if err != nil {
		return nil, fmt.Errorf("%s listener on %s: %w", name, addr, err)
	}
	s := &httpService{
		name: name,
		ln:   ln,
		srv:  &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)},
		done: make(chan struct{}),
	}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("HTTP service stopped", "service", name, "err", err)
		}
	}()
	log.Info("listening", "service", name, "addr", ln.Addr().String())
	return s, nil
}

func (s *httpService) stop() {
	if s == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	s.srv.Shutdown(ctx)
	s.srv.Close()
	<-s.done
}
