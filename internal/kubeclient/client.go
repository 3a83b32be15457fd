package kubeclient

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"

	"github.com/spinifex/konnectivity/internal/kubeapi"
)

// Client calls one apiserver with one Config's credentials. Each Client
// has its own connections; it is safe for concurrent use.
type Client struct {
	http   *http.Client
	server string // base URL, no trailing slash
}

// New returns a client of the apiserver cfg describes. It has no overall
// timeout: each call is bounded by its context.
func New(cfg *Config) *Client {
	return &Client{http: cfg.httpClient(), server: cfg.server}
}

// Do sends one request for path (with its query) and returns the answer
// of a 2xx, whose body the caller closes. A JSON body is sent when body
// is not nil. Any other answer is read up to kubeapi.MaxErrorBody, closed
// and returned as a *kubeapi.Error that keeps what was read (Body).
func (c *Client) Do(ctx context.Context, method, path string, body []byte) (*http.Response, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.server+path, rd)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "konnectivity")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		data, _ := io.ReadAll(io.LimitReader(resp.Body, kubeapi.MaxErrorBody))
		resp.Body.Close()
		e := kubeapi.DecodeStatus(resp.StatusCode, data)
		e.Body = data
		return nil, e
	}
	return resp, nil
}

// Call is Do for an answer read whole: it returns the body of a 2xx, which
// may take at most limit bytes; a longer one is an error, never a silent
// cut.
func (c *Client) Call(ctx context.Context, method, path string, body []byte, limit int64) ([]byte, error) {
	resp, err := c.Do(ctx, method, path, body)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, fmt.Errorf("read answer: %w", err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("answer larger than %d bytes", limit)
	}
	return data, nil
}

// CloseIdleConnections closes the connections no call is using; a client
// whose owner stops calls it so that none outlives it.
func (c *Client) CloseIdleConnections() { c.http.CloseIdleConnections() }
