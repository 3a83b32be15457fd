package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// commands maps subcommand names to their entry points. Each returns the
// process exit code.
var commands = map[string]func(args []string, stdout, stderr io.Writer) int{
	"server":  runServer,
	"agent":   runAgent,
	"cert":    runCert,
	"check":   runCheck,
	"demo":    runDemo,
	"status":  runStatus,
	"version": runVersion,
}

// aliases are the names the binary answers to when invoked through a symlink.
var aliases = map[string]string{
	"konnectivity-server":   "server",
	"proxy-server":          "server",
	"konnectivity-agent":    "agent",
	"proxy-agent":           "agent",
	"eks-konnectivity-cert": "cert",
}

func main() {
	os.Exit(dispatch(os.Args, os.Stdout, os.Stderr))
}

func dispatch(argv []string, stdout, stderr io.Writer) int {
	name := filepath.Base(argv[0])
	if cmd, ok := aliases[name]; ok {
		return commands[cmd](argv[1:], stdout, stderr)
	}
	if len(argv) < 2 {
		usage(stderr)
		return 2
	}
	sub := argv[1]
	switch sub {
	case "-h", "--help", "help":
		usage(stdout)
		return 0
	case "-version", "--version":
		sub = "version"
	}
	run, ok := commands[sub]
	if !ok {
		fmt.Fprintf(stderr, "konnectivity: unknown command %q\n\n", sub)
		usage(stderr)
		return 2
	}
	return run(argv[2:], stdout, stderr)
}

func usage(w io.Writer) {
	fmt.Fprint(w, `konnectivity: a way for kube-apiserver into the pod and node network.

Usage:
  konnectivity server [flags]   run the server (kube-apiserver frontend + agent listener)
  konnectivity agent [flags]    run an agent (dials the server, serves its dials)
  konnectivity cert [flags]     mint or reuse a certificate signed by a cluster CA
  konnectivity check server|agent [flags]
                                load the configuration a start would load, serve nothing
  konnectivity demo             run server, agent and a backend on loopback with a throwaway CA
  konnectivity status           show a server's agents or an agent's servers (from the admin port)
  konnectivity version          print the version, commit, build date and Go version

Invoked as konnectivity-server, konnectivity-agent or eks-konnectivity-cert it runs
that command. "konnectivity COMMAND --help" lists a command's flags; every
command takes --version.
`)
}
