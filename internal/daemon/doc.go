// Package daemon runs a long-lived process under a supervisor (OpenRC's
// supervise-daemon, systemd, a kubelet): the skeleton the server and agent
// commands share.
//
// It owns when the process stops and how it restarts:
//   - listeners are opened by name and handed across a self-restart as
//     inherited descriptors (restart.go), so a socket keeps its path and
//     inode and a port never closes (ListenUnix makes a socket with its
//     final mode from the start); the sockets the command hands over
//     (the server's paused tunnels, the agent's kept destinations) travel
//     the same way, each as the descriptor the process already has, with an entry
//     the command wrote (handover.go: Hand, Inherit);
//   - a restart is refused before anything stops unless the next image
//     would start: its executable, its configuration checked by that
//     executable (Work.Check), the descriptors the handover needs
//     (check.go);
//   - a restart (SIGHUP, or a replaced executable) re-executes the binary
//     in place, keeping the PID, after the command has drained; a stop
//     signal (SIGTERM, SIGINT) shuts the command down gracefully, a second
//     one exits at once (daemon.go);
//   - the health and admin services: /healthz, /livez, /readyz, /metrics
//     and, on the admin port only, /debug/tunnels and /debug/pprof
//     (health.go, admin.go), with the process and Go metric families of a
//     default Prometheus client (process_metrics.go);
//   - memory upkeep: the executable's start-up pages released, freed heap
//     returned to the OS after a burst (memory.go).
//   - where log lines go: klog's output settings read with klog's
//     precedence, so an upstream manifest's logs land in the same places
//     (logging.go, NewLogger); lines for stderr through a bounded queue,
//     so that a reader that stops or goes away costs lines, never the
//     process (logqueue.go).
//
// What they serve and how they stop is its callers' choice: the command
// opens its listeners through Listen, says in Work how to shut down, drain
// and clean up, and gives the readiness checks, the metrics registry and
// the status that the services show. It reads no flags and knows nothing of
// the data path: what a handed socket's entry says is the command's.
//
// Goroutines: every one the package starts has an owner that waits for it
// to end: Close (the services), Run's return (memory upkeep, the restart
// watchers), SignalContext's stop (the signal watcher), CloseLog (the
// log's writer, which an exec ends too). A Daemon belongs to
// the goroutine that runs the command and has no locks.
package daemon
