package proxydial

import (
	"bufio"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"time"
)

// maxReplyHead bounds the proxy's CONNECT reply head (status line and
// header lines). Proxies answer with a handful of short lines.
const maxReplyHead = 16 << 10

// Dialer dials addresses directly or through the proxy the environment
// names for them. It holds no state that changes after New: safe for
// concurrent use.
type Dialer struct {
	proxyFor func(*url.URL) (*url.URL, error)
	// direct dials a TCP address: the proxy, or the target when no proxy
	// applies.
	direct func(ctx context.Context, network, addr string) (net.Conn, error)
}

// FromEnvironment returns a Dialer for the process's proxy environment,
// read once per process by net/http's ProxyFromEnvironment (which is
// x/net/http/httpproxy's reading, already linked into every program that
// serves HTTP).
func FromEnvironment() *Dialer {
	return New(func(u *url.URL) (*url.URL, error) {
		return http.ProxyFromEnvironment(&http.Request{URL: u})
	})
}

// New returns a Dialer that asks proxyFor which proxy an https:// URL of
// the target goes through (nil: direct), as httpproxy.Config.ProxyFunc
// answers.
func New(proxyFor func(*url.URL) (*url.URL, error)) *Dialer {
	nd := &net.Dialer{KeepAlive: 30 * time.Second}
	return &Dialer{proxyFor: proxyFor, direct: nd.DialContext}
}

// Proxy returns the proxy that addr (host:port) is reached through, or nil
// when it is dialled directly. An error says the environment names a
// proxy that cannot be used (an unparsable URL, a scheme other than http).
func (d *Dialer) Proxy(addr string) (*url.URL, error) {
	p, err := d.proxyFor(&url.URL{Scheme: "https", Host: addr})
	if err != nil {
		return nil, fmt.Errorf("proxy for %s: %w", addr, err)
	}
	if p == nil {
		return nil, nil
	}
	if p.Scheme != "http" {
		return nil, fmt.Errorf("proxy %s for %s: scheme %q is not supported (want http)", Name(p), addr, p.Scheme)
	}
	if p.Hostname() == "" {
		return nil, fmt.Errorf("proxy %s for %s: no host", Name(p), addr)
	}
	return p, nil
}

// Name is how logs and errors name a proxy: its URL without credentials,
// path or query.
func Name(p *url.URL) string {
	if p == nil {
		return "direct"
	}
	return (&url.URL{Scheme: p.Scheme, Host: p.Host}).String()
}

// DialContext connects to addr (host:port), through the proxy the
// environment names for it if any. ctx bounds the whole exchange.
func (d *Dialer) DialContext(ctx context.Context, addr string) (net.Conn, error) {
	p, err := d.Proxy(addr)
	if err != nil {
		return nil, err
	}
	if p == nil {
		return d.direct(ctx, "tcp", addr)
	}
	return d.connect(ctx, p, addr)
}

// connect dials proxy p and asks it to connect to addr.
func (d *Dialer) connect(ctx context.Context, p *url.URL, addr string) (net.Conn, error) {
	name := Name(p)
	conn, err := d.direct(ctx, "tcp", proxyAddr(p))
	if err != nil {
		return nil, fmt.Errorf("dial proxy %s: %w", name, err)
	}
	// The context's end (its deadline, or its cancellation) interrupts
	// any read or write below.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	through, err := handshake(conn, p, addr)
	if !stop() && err == nil {
		err = ctx.Err()
	}
	if err != nil {
		conn.Close()
		if ctxErr := ctx.Err(); ctxErr != nil && !errors.Is(err, ctxErr) {
			err = fmt.Errorf("%w (%w)", err, ctxErr)
		}
		return nil, fmt.Errorf("proxy %s, CONNECT %s: %w", name, addr, err)
	}
	return through, nil
}

// handshake runs the CONNECT request and reply on conn, and returns the
// connection to the target.
func handshake(conn net.Conn, p *url.URL, addr string) (net.Conn, error) {
	if _, err := io.WriteString(conn, connectRequest(p, addr)); err != nil {
		return nil, fmt.Errorf("send: %w", err)
	}
	lim := &io.LimitedReader{R: conn, N: maxReplyHead}
	br := bufio.NewReaderSize(lim, 4096)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil {
		if lim.N == 0 {
			return nil, fmt.Errorf("reply head larger than %d bytes", maxReplyHead)
		}
		return nil, fmt.Errorf("read reply: %w", err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil, fmt.Errorf("refused: %s", resp.Status)
	}
	// TLS to the target starts with the client, so a proxy has nothing
	// to send after its head: bytes that came with it are a broken proxy.
	if br.Buffered() > 0 {
		return nil, errors.New("data after the reply head, before TLS began")
	}
	return conn, nil
}

func connectRequest(p *url.URL, addr string) string {
	req := "CONNECT " + addr + " HTTP/1.1\r\nHost: " + addr + "\r\n"
	if u := p.User; u != nil {
		pass, _ := u.Password()
		req += "Proxy-Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte(u.Username()+":"+pass)) + "\r\n"
	}
	return req + "\r\n"
}

// proxyAddr is the proxy's host:port, port 80 by default.
func proxyAddr(p *url.URL) string {
	if p.Port() != "" {
		return p.Host
	}
	return net.JoinHostPort(p.Hostname(), "80")
}
