// Command konnectivity is a small replacement for the upstream
// apiserver-network-proxy: one static binary that is the konnectivity
// server, the agent, the certificate minter and a self-contained demo.
//
// It answers to its subcommands (konnectivity server|agent|cert|version|demo)
// and, through symlinks, to the names konnectivity-server,
// konnectivity-agent and eks-konnectivity-cert, so existing init scripts
// and manifests keep working.
//
// This package is the commands: flags (flags.go, upstream's names and
// klog's), TLS and authentication set-up, and one daemon skeleton
// (daemon.go) that both long-running commands use for their listeners
// (kept across the self-restart, restart.go), health and admin services,
// memory upkeep (memory.go) and signals. The work itself lives in tunnel
// (the data path), auth and certs; this package holds no data-path logic.
package main
