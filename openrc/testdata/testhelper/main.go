// Command testhelper is a helper for openrc/test.sh (not shipped):
//
//	testhelper init -- CMD ARGS...   PID 1 of the test's pid namespace: runs
//	    CMD and reaps every orphan (supervise-daemon double-forks, and a
//	    zombie supervisor would make `supervise-daemon --stop` wait forever)
//	testhelper serve -addr 127.0.0.1:6443 -cert C -key K -client-ca CA -token-file T
//	    a fake kube-apiserver answering TokenReview for one token
//	testhelper connect -uds SOCKET -target 127.0.0.1:18080
//	    CONNECT through the konnectivity server's socket, then GET /
package main

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: testhelper init|serve|connect [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "init":
		err = initReaper(os.Args[2:])
	case "serve":
		err = serve(os.Args[2:])
	case "connect":
		err = connect(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "testhelper %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

type review struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Spec       struct {
		Token     string   `json:"token"`
		Audiences []string `json:"audiences"`
	} `json:"spec"`
	Status struct {
		Authenticated bool `json:"authenticated"`
		User          struct {
			Username string `json:"username"`
		} `json:"user"`
		Audiences []string `json:"audiences,omitempty"`
	} `json:"status"`
}

func serve(args []string) error {
	f := flag.NewFlagSet("serve", flag.ContinueOnError)
	addr := f.String("addr", "127.0.0.1:6443", "listen address")
	cert := f.String("cert", "", "serving certificate")
	key := f.String("key", "", "serving key")
	clientCA := f.String("client-ca", "", "CA the caller's client certificate must chain to")
	tokenFile := f.String("token-file", "", "the one token that authenticates")
	audience := f.String("audience", "system:konnectivity-server", "audience the token is valid for")
	user := f.String("user", "system:serviceaccount:kube-system:konnectivity-agent", "user the token belongs to")
	if err := f.Parse(args); err != nil {
		return err
	}
	pair, err := tls.LoadX509KeyPair(*cert, *key)
	if err != nil {
		return fmt.Errorf("load serving pair: %w", err)
	}
	caPEM, err := os.ReadFile(*clientCA)
	if err != nil {
		return fmt.Errorf("read client CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return errors.New("client CA: no certificate")
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /apis/authentication.k8s.io/v1/tokenreviews", func(w http.ResponseWriter, r *http.Request) {
		want, err := os.ReadFile(*tokenFile)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		var rv review
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&rv); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		audOK := false
		for _, a := range rv.Spec.Audiences {
			audOK = audOK || a == *audience
		}
		ok := audOK && rv.Spec.Token == strings.TrimSpace(string(want))
		if ok {
			rv.Status.Authenticated = true
			rv.Status.User.Username = *user
			rv.Status.Audiences = []string{*audience}
		}
		fmt.Printf("tokenreview client=%s authenticated=%v\n", r.TLS.PeerCertificates[0].Subject.CommonName, ok)
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(rv)
	})
	srv := &http.Server{
		Addr:              *addr,
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		TLSConfig: &tls.Config{
			Certificates: []tls.Certificate{pair},
			ClientCAs:    pool,
			ClientAuth:   tls.RequireAndVerifyClientCert,
		},
	}
	fmt.Printf("testhelper listening on %s\n", *addr)
	return srv.ListenAndServeTLS("", "")
}

// connect sends CONNECT over the socket, then a GET through the tunnel, and
// prints the backend's response body.
func connect(args []string) error {
	f := flag.NewFlagSet("connect", flag.ContinueOnError)
	uds := f.String("uds", "/run/konnectivity/konnectivity-server.socket", "frontend socket")
	target := f.String("target", "127.0.0.1:18080", "backend host:port")
	path := f.String("path", "/", "path to GET through the tunnel")
	if err := f.Parse(args); err != nil {
		return err
	}
	c, err := net.DialTimeout("unix", *uds, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", *target)
	br := bufio.NewReader(c)
	var head bytes.Buffer
	for !bytes.HasSuffix(head.Bytes(), []byte("\r\n\r\n")) {
		b, err := br.ReadByte()
		if err != nil {
			return fmt.Errorf("read CONNECT answer (%q so far): %w", head.String(), err)
		}
		head.WriteByte(b)
	}
	if head.String() != "HTTP/1.1 200 Connection Established\r\n\r\n" {
		rest, _ := io.ReadAll(io.LimitReader(br, 512))
		return fmt.Errorf("CONNECT answered %q %q", head.String(), rest)
	}
	fmt.Fprintf(c, "GET %s HTTP/1.0\r\nHost: %s\r\n\r\n", *path, *target)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return fmt.Errorf("read backend response: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if err != nil {
		return fmt.Errorf("read backend body: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("backend answered %s", resp.Status)
	}
	os.Stdout.Write(body)
	return nil
}

// initReaper starts args and reaps children until it exits, then exits with
// its status. As PID 1 it also inherits and reaps every orphan.
func initReaper(args []string) error {
	if len(args) > 0 && args[0] == "--" {
		args = args[1:]
	}
	if len(args) == 0 {
		return errors.New("no command")
	}
	p, err := os.StartProcess(args[0], args, &os.ProcAttr{
		Env:   os.Environ(),
		Files: []*os.File{os.Stdin, os.Stdout, os.Stderr},
	})
	if err != nil {
		return err
	}
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, 0, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("wait: %w", err)
		}
		if pid != p.Pid {
			continue
		}
		switch {
		case ws.Exited():
			os.Exit(ws.ExitStatus())
		case ws.Signaled():
			os.Exit(128 + int(ws.Signal()))
		}
	}
}
