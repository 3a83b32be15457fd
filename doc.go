// Command konnectivity is a small replacement for the upstream
// apiserver-network-proxy: one static binary that is the konnectivity
// server, the agent, the certificate minter and a self-contained demo.
//
// It answers to its subcommands (konnectivity server|agent|cert|version|demo)
// and, through symlinks, to the names konnectivity-server,
// konnectivity-agent and eks-konnectivity-cert, so existing init scripts
// and manifests keep working.
//
// This package is the commands and their flags: flags.go (upstream's
// names and klog's), TLS and authentication set-up, and the wiring of
// each command. The long-running commands run under internal/daemon
// (listeners handed across the self-restart, health and admin services,
// memory upkeep, signals); the work itself lives in tunnel (the data
// path), auth and certs. This package holds no data-path logic.
package main
