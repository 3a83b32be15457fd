package lease

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
)

// Selector is a Kubernetes label selector (the --lease-label-selector
// syntax): requirements joined by commas, each one of
//
//	key  !key  key=value  key==value  key!=value
//	key in (v1,v2)  key notin (v1,v2)  key>n  key<n
//
// The apiserver filters with it; Matches applies it again locally so that
// what is counted never depends on the server having done so.
type Selector struct {
	reqs []requirement
}

type requirement struct {
	key    string
	op     string // "exists", "!", "=", "!=", "in", "notin", ">", "<"
	values []string
}

// ParseSelector parses a label selector. An empty selector matches every
// Lease.
func ParseSelector(s string) (Selector, error) {
	p := &selParser{s: s}
	var sel Selector
	p.space()
	if p.done() {
		return sel, nil
	}
	for {
		r, err := p.requirement()
		if err != nil {
			return Selector{}, fmt.Errorf("label selector %q: %w", truncate(s, 256), err)
		}
		sel.reqs = append(sel.reqs, r)
		p.space()
		if p.done() {
			break
		}
		if !p.eat(",") {
			return Selector{}, fmt.Errorf("label selector %q: expected ',' at offset %d", truncate(s, 256), p.i)
		}
	}
	sort.SliceStable(sel.reqs, func(i, j int) bool { return sel.reqs[i].key < sel.reqs[j].key })
	return sel, nil
}

// Matches reports whether labels satisfy every requirement.
func (s Selector) Matches(labels map[string]string) bool {
	for _, r := range s.reqs {
		v, has := labels[r.key]
		switch r.op {
		case "exists":
			if !has {
				return false
			}
		case "!":
			if has {
				return false
			}
		case "=", "in":
			if !has || !contains(r.values, v) {
				return false
			}
		case "!=", "notin":
			if has && contains(r.values, v) {
				return false
			}
		case ">", "<":
			if !has {
				return false
			}
			n, err := strconv.ParseInt(v, 10, 64)
			limit, _ := strconv.ParseInt(r.values[0], 10, 64)
			if err != nil || (r.op == ">" && n <= limit) || (r.op == "<" && n >= limit) {
				return false
			}
		}
	}
	return true
}

// String is the selector in the canonical form the apiserver accepts.
func (s Selector) String() string {
	parts := make([]string, 0, len(s.reqs))
	for _, r := range s.reqs {
		switch r.op {
		case "exists":
			parts = append(parts, r.key)
		case "!":
			parts = append(parts, "!"+r.key)
		case "=", "!=", ">", "<":
			parts = append(parts, r.key+r.op+r.values[0])
		case "in", "notin":
			parts = append(parts, r.key+" "+r.op+" ("+strings.Join(r.values, ",")+")")
		}
	}
	return strings.Join(parts, ",")
}

func contains(vs []string, v string) bool {
	for _, x := range vs {
		if x == v {
			return true
		}
	}
	return false
}

type selParser struct {
	s string
	i int
}

func (p *selParser) done() bool { return p.i >= len(p.s) }

func (p *selParser) space() {
	for p.i < len(p.s) && (p.s[p.i] == ' ' || p.s[p.i] == '\t') {
		p.i++
	}
}

func (p *selParser) eat(tok string) bool {
	if strings.HasPrefix(p.s[p.i:], tok) {
		p.i += len(tok)
		return true
	}
	return false
}

// word reads a key or value: everything up to a delimiter.
func (p *selParser) word() string {
	start := p.i
	for p.i < len(p.s) && !strings.ContainsRune(" \t,()=!<>", rune(p.s[p.i])) {
		p.i++
	}
	return p.s[start:p.i]
}

func (p *selParser) requirement() (requirement, error) {
	p.space()
	if p.eat("!") {
		p.space()
		key := p.word()
		if err := validKey(key); err != nil {
			return requirement{}, err
		}
		return requirement{key: key, op: "!"}, nil
	}
	key := p.word()
	if err := validKey(key); err != nil {
		return requirement{}, err
	}
	p.space()
	switch {
	case p.done() || strings.HasPrefix(p.s[p.i:], ","):
		return requirement{key: key, op: "exists"}, nil
	case p.eat("=="), p.eat("="):
		return p.single(key, "=")
	case p.eat("!="):
		return p.single(key, "!=")
	case p.eat(">"):
		return p.number(key, ">")
	case p.eat("<"):
		return p.number(key, "<")
	}
	op := p.word()
	if op != "in" && op != "notin" {
		return requirement{}, fmt.Errorf("key %q: expected an operator (=, ==, !=, in, notin, >, <) at offset %d", key, p.i-len(op))
	}
	p.space()
	if !p.eat("(") {
		return requirement{}, fmt.Errorf("key %q: expected '(' after %s", key, op)
	}
	var values []string
	for {
		p.space()
		v := p.word()
		if err := validValue(v); err != nil {
			return requirement{}, fmt.Errorf("key %q: %w", key, err)
		}
		values = append(values, v)
		p.space()
		if p.eat(")") {
			break
		}
		if !p.eat(",") {
			return requirement{}, fmt.Errorf("key %q: expected ',' or ')' in the value set", key)
		}
	}
	if len(values) == 1 && values[0] == "" {
		return requirement{}, fmt.Errorf("key %q: the value set of %s must not be empty", key, op)
	}
	sort.Strings(values)
	return requirement{key: key, op: op, values: values}, nil
}

func (p *selParser) single(key, op string) (requirement, error) {
	p.space()
	v := p.word()
	if err := validValue(v); err != nil {
		return requirement{}, fmt.Errorf("key %q: %w", key, err)
	}
	return requirement{key: key, op: op, values: []string{v}}, nil
}

func (p *selParser) number(key, op string) (requirement, error) {
	p.space()
	v := p.word()
	if _, err := strconv.ParseInt(v, 10, 64); err != nil {
		return requirement{}, fmt.Errorf("key %q: %s needs an integer, got %q", key, op, truncate(v, 64))
	}
	return requirement{key: key, op: op, values: []string{v}}, nil
}

// ParseLabels parses the server's --lease-label: "k=v" pairs joined by
// commas, as upstream does, and checks each key and value is a valid label
// (the apiserver would refuse the Lease otherwise).
func ParseLabels(s string) (map[string]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("lease labels: empty")
	}
	labels := map[string]string{}
	for _, pair := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(pair, "=")
		if !ok || strings.Contains(v, "=") {
			return nil, fmt.Errorf("lease labels: %q: want key=value", truncate(pair, 64))
		}
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if err := validKey(k); err != nil {
			return nil, fmt.Errorf("lease labels: %w", err)
		}
		if err := validValue(v); err != nil {
			return nil, fmt.Errorf("lease labels: key %q: %w", k, err)
		}
		labels[k] = v
	}
	return labels, nil
}

// FormatLabels is the equality selector matching exactly labels (sorted
// keys, "k=v,k2=v2").
func FormatLabels(labels map[string]string) string {
	keys := make([]string, 0, len(labels))
	for k := range labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + labels[k]
	}
	return strings.Join(parts, ",")
}

// validKey checks a label key: an optional DNS subdomain prefix and '/',
// then a name of at most 63 characters.
func validKey(k string) error {
	if k == "" {
		return errors.New("empty label key")
	}
	name := k
	if prefix, rest, ok := strings.Cut(k, "/"); ok {
		if err := validName(prefix, 253); err != nil {
			return fmt.Errorf("label key %q: prefix %w", truncate(k, 64), err)
		}
		name = rest
	}
	if name == "" || len(name) > 63 || !labelChars(name) {
		return fmt.Errorf("label key %q: the name must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit", truncate(k, 64))
	}
	return nil
}

// validValue checks a label value: empty, or at most 63 characters as a
// key's name part.
func validValue(v string) error {
	if v == "" {
		return nil
	}
	if len(v) > 63 || !labelChars(v) {
		return fmt.Errorf("label value %q: must be at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit", truncate(v, 64))
	}
	return nil
}

func labelChars(s string) bool {
	alnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' }
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !alnum(c) && (c != '-' && c != '_' && c != '.' || i == 0 || i == len(s)-1) {
			return false
		}
	}
	return true
}
