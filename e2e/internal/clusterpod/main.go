// Command clusterpod is every process of the e2e-cluster test's own images
// and the reaper of its containerd, one static binary chosen by its first
// argument:
//
//	pause             the pod sandbox: waits for SIGTERM or SIGINT
//	webhook CERT KEY  a validating admission webhook on :8443 that admits
//	                  every object except one named deny-*
//	workload          prints "line N" every 100ms, echoes TCP on :8080 and
//	                  answers HTTP on :8081 with "pod HOSTNAME", closing
//	                  the connection after each answer
//	cat               copies stdin to stdout (exec and attach)
//	reaper CMD ARG... runs CMD as a child subreaper: reaps every process
//	                  reparented to it (containerd's shims), passes SIGTERM
//	                  on, and exits once CMD and every other child are gone
package main

import (
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: clusterpod pause|webhook CERT KEY|workload|cat|reaper CMD ARG...")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "pause":
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
		<-sig
	case "webhook":
		if len(os.Args) != 4 {
			err = errors.New("usage: clusterpod webhook CERT KEY")
			break
		}
		err = webhook(os.Args[2], os.Args[3])
	case "workload":
		err = workload()
	case "cat":
		_, err = io.Copy(os.Stdout, os.Stdin)
	case "reaper":
		err = reaper(os.Args[2:])
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "clusterpod:", err)
		os.Exit(1)
	}
}

// webhook answers AdmissionReviews: it admits every object except one whose
// name starts with "deny-", and says so with the name, so the client sees
// bytes only the webhook could have written.
func webhook(certFile, keyFile string) error {
	pair, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return err
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var review struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Request    struct {
				UID    string `json:"uid"`
				Object struct {
					Metadata struct {
						Name string `json:"name"`
					} `json:"metadata"`
				} `json:"object"`
			} `json:"request"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&review); err != nil || review.Kind != "AdmissionReview" {
			http.Error(w, "not an AdmissionReview", http.StatusBadRequest)
			return
		}
		name := review.Request.Object.Metadata.Name
		resp := map[string]any{"uid": review.Request.UID, "allowed": true}
		if strings.HasPrefix(name, "deny-") {
			resp["allowed"] = false
			resp["status"] = map[string]any{"code": 403, "message": "e2e webhook pod denies " + name}
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"apiVersion": review.APIVersion, "kind": "AdmissionReview", "response": resp})
	})
	srv := &http.Server{
		Addr:              ":8443",
		Handler:           h,
		TLSConfig:         &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12},
		ReadHeaderTimeout: 10 * time.Second,
	}
	go stopOnSignal(func() { srv.Close() })
	if err := srv.ListenAndServeTLS("", ""); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// workload writes a numbered line every 100ms (kubectl logs -f), echoes
// every TCP connection on :8080 (kubectl port-forward) and names its pod
// over HTTP on :8081 (pods/proxy).
func workload() error {
	l, err := net.Listen("tcp", ":8080")
	if err != nil {
		return err
	}
	hl, err := net.Listen("tcp", ":8081")
	if err != nil {
		return err
	}
	host, _ := os.Hostname()
	hs := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			// A connection per request: each of kube-apiserver's
			// requests is a dial of its own through the tunnel.
			w.Header().Set("Connection", "close")
			fmt.Fprintf(w, "pod %s\n", host)
		}),
		ReadHeaderTimeout: 10 * time.Second,
	}
	go func() { _ = hs.Serve(hl) }()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	go stopOnSignal(func() { os.Exit(0) })
	for i := 0; ; i++ {
		fmt.Printf("line %d\n", i)
		time.Sleep(100 * time.Millisecond)
	}
}

func stopOnSignal(stop func()) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	stop()
}

// reaper runs args as a child subreaper: containerd's shims daemonize and
// are reparented to it rather than to the test (PID 1 of its namespace,
// which reaps only its own children), so they are reaped, and the reaper
// exits only when the last of them has exited: the test waits for the
// shims by waiting for the reaper.
func reaper(args []string) error {
	if len(args) == 0 {
		return errors.New("usage: clusterpod reaper CMD ARG")
	}
	if err := setChildSubreaper(); err != nil {
		return err
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, os.Stdout, os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	main := cmd.Process.Pid
	go func() {
		for s := range sig {
			_ = cmd.Process.Signal(s)
		}
	}()
	var mainStatus syscall.WaitStatus
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, 0, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if errors.Is(err, syscall.ECHILD) {
			break
		}
		if err != nil {
			return err
		}
		if pid == main {
			mainStatus = ws
		}
	}
	if mainStatus.ExitStatus() != 0 {
		return fmt.Errorf("%s: %v", args[0], mainStatus)
	}
	return nil
}

func setChildSubreaper() error {
	const prSetChildSubreaper = 36
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); e != 0 {
		return fmt.Errorf("prctl(PR_SET_CHILD_SUBREAPER): %w", e)
	}
	return nil
}
