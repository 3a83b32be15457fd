package kubeclient

import (
	"bytes"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// LoadKubeconfig reads the kubeconfig at path and returns the config of the
// named context, or of current-context when context is empty. Relative file
// names inside it are resolved against the kubeconfig's folder. With an
// empty path and context it returns InClusterConfig(), like upstream.
func LoadKubeconfig(path, context string) (*Config, error) {
	if path == "" {
		if context != "" {
			return nil, fmt.Errorf("kubeconfig context %q given without a kubeconfig path", context)
		}
		return InClusterConfig()
	}
	data, err := readRegularFile(path, maxKubeconfigSize)
	if err != nil {
		return nil, fmt.Errorf("read kubeconfig: %w", err)
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	cfg, err := parseKubeconfig(data, filepath.Dir(abs), context, readRegularFile)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	return cfg, nil
}

// parseKubeconfig walks the YAML node tree (package yaml's Node) by hand
// rather than unmarshalling into structs so that every error can name the
// offending field, and so that no error ever echoes a value (which might be
// a token or key).
func parseKubeconfig(data []byte, dir, context string, readFile func(string, int64) ([]byte, error)) (*Config, error) {
	doc, err := parseYAML(data)
	if err != nil {
		return nil, fmt.Errorf("not valid YAML: %w", err)
	}
	if doc == nil {
		return nil, errors.New("empty")
	}
	top, err := mapping(doc, "top level")
	if err != nil {
		return nil, err
	}

	name := context
	if name == "" {
		if name, err = str(top, "current-context"); err != nil {
			return nil, err
		}
		if name == "" {
			return nil, errors.New("current-context: not set (select a context explicitly)")
		}
	}
	contexts, err := named(top, "contexts", "context")
	if err != nil {
		return nil, err
	}
	ctxNode, ok := contexts[name]
	if !ok {
		return nil, fmt.Errorf("context %q: not found", name)
	}
	where := fmt.Sprintf("context %q", name)
	ctxFields, err := mapping(ctxNode, "context")
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	clusterName, err := str(ctxFields, "cluster")
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	if clusterName == "" {
		return nil, fmt.Errorf("%s: cluster: not set", where)
	}
	userName, err := str(ctxFields, "user")
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}

	clusters, err := named(top, "clusters", "cluster")
	if err != nil {
		return nil, err
	}
	clusterNode, ok := clusters[clusterName]
	if !ok {
		return nil, fmt.Errorf("%s: cluster %q: not found", where, clusterName)
	}
	cfg := &Config{readFile: readFile}
	if err := parseCluster(cfg, clusterNode, dir, readFile); err != nil {
		return nil, fmt.Errorf("%s: cluster %q: %w", where, clusterName, err)
	}

	if userName != "" { // no user: anonymous, which client-go allows too
		users, err := named(top, "users", "user")
		if err != nil {
			return nil, err
		}
		userNode, ok := users[userName]
		if !ok {
			return nil, fmt.Errorf("%s: user %q: not found", where, userName)
		}
		if err := parseUser(cfg, userNode, dir, readFile); err != nil {
			return nil, fmt.Errorf("%s: user %q: %w", where, userName, err)
		}
	}
	return cfg, nil
}

func parseCluster(cfg *Config, n *yaml.Node, dir string, readFile func(string, int64) ([]byte, error)) error {
	m, err := mapping(n, "cluster")
	if err != nil {
		return err
	}
	server, err := str(m, "server")
	if err != nil {
		return err
	}
	if cfg.server, err = serverURL(server); err != nil {
		return fmt.Errorf("server: %w", err)
	}
	if cfg.tlsServerName, err = str(m, "tls-server-name"); err != nil {
		return err
	}
	if cfg.insecure, err = boolean(m, "insecure-skip-tls-verify"); err != nil {
		return err
	}
	proxyURL, err := str(m, "proxy-url")
	if err != nil {
		return err
	}
	if proxyURL != "" {
		u, err := url.Parse(proxyURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return errors.New("proxy-url: must be an http:// or https:// URL")
		}
		cfg.proxy = u
	}

	caPEM, caField, err := dataOrFile(m, "certificate-authority", dir, readFile)
	if err != nil {
		return err
	}
	if caPEM != nil {
		if cfg.insecure {
			// Same rule as client-go: the two contradict each other.
			return fmt.Errorf("insecure-skip-tls-verify: not allowed together with %s", caField)
		}
		if cfg.rootCAs, err = certPool(caPEM); err != nil {
			return fmt.Errorf("%s: %w", caField, err)
		}
	}
	return nil
}

func serverURL(s string) (string, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return "", errors.New("not set")
	}
	if !strings.Contains(s, "://") {
		s = "https://" + s // client-go also accepts a bare host:port
	}
	u, err := url.Parse(s)
	if err != nil {
		return "", errors.New("not a valid URL")
	}
	if u.Scheme != "https" && u.Scheme != "http" {
		return "", errors.New("must be an https:// or http:// URL")
	}
	if u.Host == "" {
		return "", errors.New("has no host")
	}
	if u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return "", errors.New("must not contain user info, a query or a fragment")
	}
	u.Path = strings.TrimRight(u.Path, "/")
	u.RawPath = strings.TrimRight(u.RawPath, "/")
	return u.String(), nil
}

func parseUser(cfg *Config, n *yaml.Node, dir string, readFile func(string, int64) ([]byte, error)) error {
	m, err := mapping(n, "user")
	if err != nil {
		return err
	}
	// Refuse what we cannot honour rather than silently calling the apiserver
	// as somebody else (or as nobody).
	for _, k := range []struct{ key, why string }{
		{"exec", "credential plugins are not supported"},
		{"auth-provider", "auth providers are not supported"},
		{"username", "basic authentication is not supported"},
		{"password", "basic authentication is not supported"},
		{"as", "impersonation is not supported"},
		{"as-uid", "impersonation is not supported"},
		{"as-groups", "impersonation is not supported"},
		{"as-user-extra", "impersonation is not supported"},
	} {
		if v, ok := m[k.key]; ok && !isNull(v) {
			return fmt.Errorf("%s: %s", k.key, k.why)
		}
	}

	certPEM, certField, err := dataOrFile(m, "client-certificate", dir, readFile)
	if err != nil {
		return err
	}
	keyPEM, keyField, err := dataOrFile(m, "client-key", dir, readFile)
	if err != nil {
		return err
	}
	switch {
	case certPEM != nil && keyPEM == nil:
		return fmt.Errorf("client-key-data or client-key: not set (%s is set)", certField)
	case keyPEM != nil && certPEM == nil:
		return fmt.Errorf("client-certificate-data or client-certificate: not set (%s is set)", keyField)
	case certPEM != nil:
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return fmt.Errorf("%s, %s: %w", certField, keyField, err)
		}
		cfg.clientCert = &pair
	}

	if cfg.token, err = str(m, "token"); err != nil {
		return err
	}
	cfg.token = strings.TrimSpace(cfg.token)
	tokenFile, err := str(m, "tokenFile")
	if err != nil {
		return err
	}
	if tokenFile != "" {
		// Like client-go, a readable tokenFile wins over an inline token.
		cfg.tokenFile = resolvePath(dir, tokenFile)
		if err := checkTokenFile(cfg.tokenFile, readFile); err != nil {
			return fmt.Errorf("tokenFile: %w", err)
		}
	}
	return nil
}

// dataOrFile returns the PEM from "<key>-data" (base64) or, if that is
// unset, from the file named by "<key>", and which of the two it used.
func dataOrFile(m map[string]*yaml.Node, key, dir string, readFile func(string, int64) ([]byte, error)) ([]byte, string, error) {
	dataKey := key + "-data"
	b64, err := str(m, dataKey)
	if err != nil {
		return nil, "", err
	}
	if b64 = strings.TrimSpace(b64); b64 != "" {
		data, err := base64.StdEncoding.DecodeString(b64) // ignores embedded newlines
		if err != nil {
			return nil, "", fmt.Errorf("%s: not valid base64", dataKey)
		}
		if len(data) == 0 {
			return nil, "", fmt.Errorf("%s: empty", dataKey)
		}
		return data, dataKey, nil
	}
	file, err := str(m, key)
	if err != nil {
		return nil, "", err
	}
	if file == "" {
		return nil, "", nil
	}
	data, err := readFile(resolvePath(dir, file), maxCredentialFileSize)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", key, err)
	}
	if len(data) == 0 {
		return nil, "", fmt.Errorf("%s: file is empty", key)
	}
	return data, key, nil
}

func resolvePath(dir, p string) string {
	if filepath.IsAbs(p) || dir == "" {
		return p
	}
	return filepath.Join(dir, p)
}

// parseYAML reads data's one YAML document and returns its root (nil when
// the document is empty). Its errors name a line and never a value: yaml's
// own message is kept only when it quotes nothing of the input (a token,
// a key) and is otherwise replaced by a fixed one.
func parseYAML(data []byte) (*yaml.Node, error) {
	if len(data) > maxKubeconfigSize {
		return nil, fmt.Errorf("larger than %d bytes", maxKubeconfigSize)
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, nil
		}
		return nil, yamlError(err)
	}
	var next yaml.Node
	switch err := dec.Decode(&next); {
	case errors.Is(err, io.EOF):
	case err != nil:
		return nil, yamlError(err)
	default:
		return nil, fmt.Errorf("line %d: a second document (a kubeconfig is one)", next.Line)
	}
	if len(doc.Content) == 0 {
		return nil, nil
	}
	return doc.Content[0], nil
}

// yamlError rewrites a parse error of package yaml ("yaml: line 2: found
// character that cannot start any token") as "line 2: found character that
// cannot start any token", dropping what is wrong when it quotes the input.
func yamlError(err error) error {
	msg, _ := strings.CutPrefix(err.Error(), "yaml: ")
	line := ""
	if rest, ok := strings.CutPrefix(msg, "line "); ok {
		if n, after, ok := strings.Cut(rest, ": "); ok {
			if _, aerr := strconv.Atoi(n); aerr == nil {
				line, msg = "line "+n, after
			}
		}
	}
	if strings.ContainsAny(msg, "'\"`") || len(msg) > 80 {
		msg = "not YAML this reader accepts"
	}
	if line == "" {
		return errors.New(msg)
	}
	return fmt.Errorf("%s: %s", line, msg)
}

// deref is the node an alias names, or n itself.
func deref(n *yaml.Node) *yaml.Node {
	if n != nil && n.Kind == yaml.AliasNode && n.Alias != nil {
		return n.Alias
	}
	return n
}

func isNull(n *yaml.Node) bool {
	n = deref(n)
	return n == nil || n.Kind == yaml.ScalarNode && n.Tag == "!!null"
}

// mapping returns a YAML mapping's values by key; null counts as empty.
func mapping(n *yaml.Node, what string) (map[string]*yaml.Node, error) {
	m := map[string]*yaml.Node{}
	if isNull(n) {
		return m, nil
	}
	n = deref(n)
	if n.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%s: line %d: expected a mapping", what, n.Line)
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := deref(n.Content[i])
		if k.Kind != yaml.ScalarNode {
			continue // no kubeconfig field has a non-scalar key
		}
		if _, dup := m[k.Value]; dup {
			return nil, fmt.Errorf("%s: line %d: duplicate key", what, k.Line)
		}
		m[k.Value] = n.Content[i+1]
	}
	return m, nil
}

// str returns a scalar field as a string ("" if absent or null).
func str(m map[string]*yaml.Node, key string) (string, error) {
	n, ok := m[key]
	if !ok || isNull(n) {
		return "", nil
	}
	n = deref(n)
	if n.Kind != yaml.ScalarNode {
		return "", fmt.Errorf("%s: line %d: expected a string", key, n.Line)
	}
	return n.Value, nil
}

func boolean(m map[string]*yaml.Node, key string) (bool, error) {
	n, ok := m[key]
	if !ok || isNull(n) {
		return false, nil
	}
	n = deref(n)
	if n.Kind == yaml.ScalarNode && (n.Tag == "!!bool" || n.Tag == "!!str") {
		// YAML's booleans when plain (the library tags them !!bool); like
		// yaml decoding into a bool, YAML 1.1's yes/no/on/off also when
		// quoted.
		if n.Tag == "!!bool" {
			switch n.Value {
			case "true", "True", "TRUE":
				return true, nil
			case "false", "False", "FALSE":
				return false, nil
			}
		}
		switch n.Value {
		case "y", "Y", "yes", "Yes", "YES", "on", "On", "ON":
			return true, nil
		case "n", "N", "no", "No", "NO", "off", "Off", "OFF":
			return false, nil
		}
	}
	return false, fmt.Errorf("%s: line %d: expected true or false", key, n.Line)
}

// named indexes a kubeconfig list such as clusters ([{name, cluster}]) by
// name, returning each entry's inner field (here "cluster").
func named(top map[string]*yaml.Node, list, inner string) (map[string]*yaml.Node, error) {
	out := map[string]*yaml.Node{}
	n, ok := top[list]
	if !ok || isNull(n) {
		return out, nil
	}
	n = deref(n)
	if n.Kind != yaml.SequenceNode {
		return nil, fmt.Errorf("%s: line %d: expected a list", list, n.Line)
	}
	for i, item := range n.Content {
		where := fmt.Sprintf("%s[%d]", list, i)
		m, err := mapping(item, where)
		if err != nil {
			return nil, err
		}
		name, err := str(m, "name")
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if name == "" {
			return nil, fmt.Errorf("%s: name: not set", where)
		}
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("%s: name %q: defined twice", where, name)
		}
		v, ok := m[inner]
		if !ok {
			v = &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!null"}
		}
		out[name] = v
	}
	return out, nil
}
