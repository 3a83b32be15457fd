package yamlnode

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// MaxDepth is the deepest nesting of collections Parse accepts.
const MaxDepth = 64

// Kind says what a Node is.
type Kind uint8

// The kinds of node.
const (
	Scalar Kind = iota + 1
	Mapping
	Sequence
)

// Node is one scalar, mapping or sequence. A mapping's Content holds keys and
// values alternately, in document order; a sequence's holds its items.
type Node struct {
	Kind    Kind
	Tag     string // explicit standard tag such as "!!str"; "" when none
	Value   string // a scalar's text after unquoting and folding
	Plain   bool   // a scalar written without quotes or block indicator
	Line    int    // 1-based position of the node's first character
	Column  int
	Content []*Node
}

// IsNull reports whether n is YAML's null: absent, empty, or a plain "~" or
// "null" not tagged otherwise.
func (n *Node) IsNull() bool {
	if n == nil || n.Tag == "!!null" {
		return true
	}
	if n.Kind != Scalar || !n.Plain || n.Tag != "" {
		return false
	}
	switch n.Value {
	case "", "~", "null", "Null", "NULL":
		return true
	}
	return false
}

// Error is a refusal or syntax error. It names a position and never quotes
// the input, which may hold a secret.
type Error struct {
	Line, Column int
	Msg          string
}

func (e *Error) Error() string {
	return fmt.Sprintf("line %d: %s at column %d", e.Line, e.Msg, e.Column)
}

// Parse reads one YAML document. It returns nil, nil for a document with no
// content (empty, or only comments).
func Parse(data []byte) (*Node, error) {
	data = bytes.TrimPrefix(data, []byte("\xef\xbb\xbf"))
	data = bytes.ReplaceAll(data, []byte("\r\n"), []byte("\n"))
	data = bytes.ReplaceAll(data, []byte("\r"), []byte("\n")) // a lone CR ends a line too
	p := &parser{src: data, line: 1, maxNodes: 2*len(data) + 16, anchors: map[string]*Node{}}
	for !p.eof() { // UTF-16 and stray bytes are refused, not guessed at
		r, size := utf8.DecodeRune(p.src[p.pos:])
		if r == utf8.RuneError && size == 1 {
			return nil, p.err("not valid UTF-8")
		}
		if r == '\n' {
			p.advance()
		} else {
			p.pos += size
		}
	}
	p.pos, p.line, p.lineStart = 0, 1, 0
	return p.document()
}

// parser is used by one goroutine, for one call of Parse.
type parser struct {
	src       []byte
	pos       int // offset of the next byte
	line      int // 1-based line of pos
	lineStart int // offset of the first byte of that line
	nodes     int // nodes made so far
	maxNodes  int
	depth     int
	anchors   map[string]*Node
}

func (p *parser) col() int { return p.pos - p.lineStart } // 0-based

func (p *parser) errAt(line, col int, format string, args ...any) error {
	return &Error{Line: line, Column: col + 1, Msg: fmt.Sprintf(format, args...)}
}

func (p *parser) err(format string, args ...any) error {
	return p.errAt(p.line, p.col(), format, args...)
}

func (p *parser) eof() bool { return p.pos >= len(p.src) }

func (p *parser) peek(off int) byte {
	if p.pos+off < len(p.src) && p.pos+off >= 0 {
		return p.src[p.pos+off]
	}
	return 0
}

// blankAt reports whether offset off from pos is a space, tab, line end or
// the end of input: what must follow "-", ":" and similar indicators.
func (p *parser) blankAt(off int) bool {
	c := p.peek(off)
	return c == 0 && p.pos+off >= len(p.src) || c == ' ' || c == '\t' || c == '\n'
}

func (p *parser) advance() {
	if p.src[p.pos] == '\n' {
		p.line++
		p.lineStart = p.pos + 1
	}
	p.pos++
}

func (p *parser) newNode(kind Kind, line, col int) (*Node, error) {
	p.nodes++
	if p.nodes > p.maxNodes {
		return nil, p.errAt(line, col, "too many nodes")
	}
	return &Node{Kind: kind, Line: line, Column: col + 1}, nil
}

// skipInline skips spaces and tabs, and a comment to the end of the line.
func (p *parser) skipInline() {
	for !p.eof() && (p.src[p.pos] == ' ' || p.src[p.pos] == '\t') {
		p.pos++
	}
	if !p.eof() && p.src[p.pos] == '#' && (p.pos == p.lineStart || p.src[p.pos-1] == ' ' || p.src[p.pos-1] == '\t') {
		for !p.eof() && p.src[p.pos] != '\n' {
			p.pos++
		}
	}
}

// nextContent moves to the first content character of the next line that
// has any, and returns its indentation; -1 at the end of input.
func (p *parser) nextContent() (int, error) {
	for {
		p.skipInline()
		if p.eof() {
			return -1, nil
		}
		if p.src[p.pos] != '\n' {
			if p.pos != p.lineStart {
				return 0, p.err("expected the end of the line")
			}
		} else {
			p.advance()
		}
		// At a line start: measure the indentation.
		for !p.eof() && p.src[p.pos] == ' ' {
			p.pos++
		}
		if p.eof() {
			return -1, nil
		}
		switch p.src[p.pos] {
		case '\n':
			continue
		case '#':
			p.skipInline()
			continue
		case '\t':
			q := p.pos
			for q < len(p.src) && (p.src[q] == ' ' || p.src[q] == '\t') {
				q++
			}
			if q < len(p.src) && p.src[q] != '\n' && p.src[q] != '#' {
				return 0, p.err("found character that cannot start any token (a tab as indentation)")
			}
			p.pos = q
			p.skipInline()
			continue
		}
		return p.col(), nil
	}
}

// atLineEnd skips blanks and a comment and reports whether the line ends.
func (p *parser) atLineEnd() bool {
	p.skipInline()
	return p.eof() || p.src[p.pos] == '\n'
}

// marker reports a document marker ("---" or "...") at the current position,
// which must be a line start.
func (p *parser) marker() string {
	if p.pos != p.lineStart || p.pos+3 > len(p.src) {
		return ""
	}
	s := string(p.src[p.pos : p.pos+3])
	if (s == "---" || s == "...") && p.blankAt(3) {
		return s
	}
	return ""
}

func (p *parser) document() (*Node, error) {
	ind, err := p.nextContent()
	if err != nil || ind < 0 {
		return nil, err
	}
	if p.src[p.pos] == '%' && ind == 0 {
		return nil, p.err("directives are not supported")
	}
	var root *Node
	inline := false // the node started on the "---" line
	if p.marker() == "---" {
		// An explicit document is never empty: with no content it is null.
		if root, err = p.newNode(Scalar, p.line, p.col()); err != nil {
			return nil, err
		}
		root.Plain = true
		p.pos += 3
		if !p.atLineEnd() {
			// "--- value" or "--- {..}": the node starts on the marker line.
			inline = true
			if c := p.src[p.pos]; c == '&' || c == '!' {
				return nil, p.err("properties on the document marker line are not supported")
			}
			if root, err = p.inlineNode(-1, p.col()); err != nil {
				return nil, err
			}
		}
		if ind, err = p.nextContent(); err != nil {
			return nil, err
		}
	}
	if !inline && ind >= 0 && p.marker() == "" {
		if root, err = p.node(ind, -1); err != nil {
			return nil, err
		}
		if ind, err = p.nextContent(); err != nil {
			return nil, err
		}
	}
	if ind >= 0 && p.marker() == "..." {
		p.pos += 3
		if ind, err = p.nextContent(); err != nil {
			return nil, err
		}
	}
	if ind >= 0 {
		if p.marker() != "" {
			return nil, p.err("several documents are not supported")
		}
		return nil, p.err("unexpected content after the document")
	}
	return root, nil
}

// properties reads an optional anchor and tag before a node.
func (p *parser) properties() (anchor, tag string, err error) {
	for !p.eof() {
		switch p.src[p.pos] {
		case '&':
			if anchor != "" {
				return "", "", p.err("two anchors on one node")
			}
			if anchor = p.name(); anchor == "" {
				return "", "", p.err("an anchor name must be letters, digits, '-' or '_'")
			}
		case '!':
			if tag != "" {
				return "", "", p.err("two tags on one node")
			}
			start := p.pos
			for !p.blankAt(0) && !p.eof() && !strings.ContainsRune(",[]{}", rune(p.src[p.pos])) {
				p.pos++
			}
			tag = string(p.src[start:p.pos])
			switch tag {
			case "!!str", "!!null", "!!bool", "!!int", "!!float", "!!binary", "!!timestamp", "!!map", "!!seq":
			default:
				return "", "", p.errAt(p.line, start-p.lineStart, "only the standard !! tags are supported")
			}
		case '*':
			if anchor != "" || tag != "" {
				return "", "", p.err("properties on an alias are not allowed")
			}
			return "", "", nil
		default:
			return anchor, tag, nil
		}
		for !p.eof() && (p.src[p.pos] == ' ' || p.src[p.pos] == '\t') {
			p.pos++
		}
	}
	return anchor, tag, nil
}

// name reads an anchor or alias name after its '&' or '*'.
func (p *parser) name() string {
	p.pos++
	start := p.pos
	for !p.eof() {
		c := p.src[p.pos]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			break
		}
		p.pos++
	}
	if !p.eof() && !p.blankAt(0) && strings.IndexByte(",]}", p.src[p.pos]) < 0 {
		return "" // the callers refuse an empty name
	}
	return string(p.src[start:p.pos])
}

func (p *parser) alias() (*Node, error) {
	line, col := p.line, p.col()
	name := p.name()
	n, ok := p.anchors[name]
	if !ok || name == "" {
		return nil, p.errAt(line, col, "unknown anchor")
	}
	return n, nil
}

func (p *parser) finish(n *Node, anchor, tag string, line, col int) (*Node, error) {
	if tag != "" {
		ok := tag != "!!map" && tag != "!!seq"
		switch n.Kind {
		case Mapping:
			ok = tag == "!!map"
		case Sequence:
			ok = tag == "!!seq"
		}
		if !ok {
			return nil, p.errAt(line, col, "tag does not fit the node")
		}
		n.Tag = tag
	}
	if anchor != "" || tag != "" {
		n.Line, n.Column = line, col+1
	}
	if anchor != "" {
		if _, dup := p.anchors[anchor]; dup {
			// YAML lets a later anchor shadow an earlier one; readers differ
			// on what an alias inside the new node then means.
			return nil, p.errAt(line, col, "anchor defined twice")
		}
		p.anchors[anchor] = n
	}
	return n, nil
}

func (p *parser) enter() error {
	p.depth++
	if p.depth > MaxDepth {
		return p.err("nested deeper than %d", MaxDepth)
	}
	return nil
}

// node reads a block node whose first character is at the current position,
// at column ind; parent is the indentation of the enclosing block collection.
func (p *parser) node(ind, parent int) (*Node, error) {
	line, col := p.line, p.col()
	anchor, tag, err := p.properties()
	if err != nil {
		return nil, err
	}
	if anchor != "" || tag != "" {
		if p.atLineEnd() {
			// The properties stand alone; the node is on the next lines.
			next, err := p.nextContent()
			if err != nil {
				return nil, err
			}
			if next >= 0 && (p.src[p.pos] == '&' || p.src[p.pos] == '!') {
				return nil, p.err("properties on a line of their own before more properties are not supported")
			}
			var n *Node
			switch {
			case next > parent && p.marker() == "":
				n, err = p.node(next, parent)
			default:
				p.rewindLine()
				n, err = p.newNode(Scalar, line, col)
				if n != nil {
					n.Plain = true
				}
			}
			if err != nil {
				return nil, err
			}
			return p.finish(n, anchor, tag, line, col)
		}
		if p.isKey() {
			return nil, p.err("properties on a mapping key are not supported")
		}
		n, err := p.inlineNode(parent, p.col())
		if err != nil {
			return nil, err
		}
		return p.finish(n, anchor, tag, line, col)
	}
	switch {
	case p.src[p.pos] == '?' && p.blankAt(1):
		return nil, p.err("complex keys are not supported")
	case p.src[p.pos] == '-' && p.blankAt(1):
		return p.sequence(ind)
	case p.isKey():
		return p.mapping(ind)
	}
	return p.inlineNode(parent, ind)
}

// rewindLine leaves the position at the end of the previous content line so
// that the caller's nextContent sees the line again.
func (p *parser) rewindLine() {
	if p.eof() {
		return // nextContent finds the end again
	}
	if p.lineStart == 0 {
		p.pos = 0 // nextContent measures the first line from its start
		return
	}
	p.pos = p.lineStart - 1
	p.line--
	p.lineStart = bytes.LastIndexByte(p.src[:p.pos], '\n') + 1
}

// isKey reports whether an implicit mapping key starts at the position.
func (p *parser) isKey() bool {
	save, saveLine, saveStart := p.pos, p.line, p.lineStart
	defer func() { p.pos, p.line, p.lineStart = save, saveLine, saveStart }()
	switch c := p.src[p.pos]; c {
	case '"', '\'':
		if _, err := p.quoted(); err != nil || p.line != saveLine {
			return false
		}
		for !p.eof() && (p.src[p.pos] == ' ' || p.src[p.pos] == '\t') {
			p.pos++
		}
		return p.peek(0) == ':' && p.blankAt(1)
	case '[', '{', '?', '*', '&', '!', '|', '>', '#':
		return false
	}
	for !p.eof() && p.src[p.pos] != '\n' {
		if p.src[p.pos] == ':' && p.blankAt(1) {
			return true
		}
		if p.src[p.pos] == '#' && (p.src[p.pos-1] == ' ' || p.src[p.pos-1] == '\t') {
			return false
		}
		p.pos++
	}
	return false
}

func (p *parser) sequence(ind int) (*Node, error) {
	if err := p.enter(); err != nil {
		return nil, err
	}
	defer func() { p.depth-- }()
	n, err := p.newNode(Sequence, p.line, p.col())
	if err != nil {
		return nil, err
	}
	for {
		p.pos++ // the '-'
		item, err := p.value(ind, false)
		if err != nil {
			return nil, err
		}
		n.Content = append(n.Content, item)
		next, err := p.nextContent()
		if err != nil {
			return nil, err
		}
		if next < ind || p.marker() != "" {
			p.rewindLine()
			return n, nil
		}
		if next > ind || p.src[p.pos] != '-' || !p.blankAt(1) {
			if next == ind && p.isKey() {
				p.rewindLine()
				return n, nil // a sequence at its key's indentation ends here
			}
			return nil, p.err("expected a sequence entry")
		}
	}
}

func (p *parser) mapping(ind int) (*Node, error) {
	if err := p.enter(); err != nil {
		return nil, err
	}
	defer func() { p.depth-- }()
	n, err := p.newNode(Mapping, p.line, p.col())
	if err != nil {
		return nil, err
	}
	for {
		if p.src[p.pos] == '?' && p.blankAt(1) {
			return nil, p.err("complex keys are not supported")
		}
		if !p.isKey() {
			if p.src[p.pos] == '-' && p.blankAt(1) {
				return nil, p.err("a sequence entry is not allowed here")
			}
			return nil, p.err("expected a mapping key")
		}
		key, err := p.keyScalar()
		if err != nil {
			return nil, err
		}
		for p.src[p.pos] != ':' {
			p.pos++
		}
		p.pos++
		val, err := p.value(ind, true)
		if err != nil {
			return nil, err
		}
		n.Content = append(n.Content, key, val)
		next, err := p.nextContent()
		if err != nil {
			return nil, err
		}
		if next < ind || p.marker() != "" {
			p.rewindLine()
			return n, nil
		}
		if next > ind {
			return nil, p.err("mapping values are not allowed in this context (unexpected indentation)")
		}
	}
}

func (p *parser) keyScalar() (*Node, error) {
	if c := p.src[p.pos]; c == '"' || c == '\'' {
		return p.quoted()
	}
	n, err := p.newNode(Scalar, p.line, p.col())
	if err != nil {
		return nil, err
	}
	start := p.pos
	for !(p.src[p.pos] == ':' && p.blankAt(1)) {
		p.pos++
	}
	n.Value = strings.TrimRight(string(p.src[start:p.pos]), " \t")
	n.Plain = true
	return n, nil
}

// value reads what follows a "key:" or "- " indicator of a block collection
// at indentation ind.
func (p *parser) value(ind int, inMapping bool) (*Node, error) {
	line, col := p.line, p.col()
	if !p.atLineEnd() {
		col = p.col()
		if p.src[p.pos] == '-' && p.blankAt(1) && inMapping {
			return nil, p.err("block sequence entries are not allowed in this context")
		}
		if inMapping {
			anchor, tag, err := p.properties()
			if err != nil {
				return nil, err
			}
			if anchor != "" || tag != "" {
				if p.atLineEnd() {
					n, err := p.valueBelow(ind, inMapping, line, col, true)
					if err != nil {
						return nil, err
					}
					return p.finish(n, anchor, tag, line, col)
				}
				n, err := p.inlineNode(ind, p.col())
				if err != nil {
					return nil, err
				}
				return p.finish(n, anchor, tag, line, col)
			}
			return p.inlineNode(ind, p.col())
		}
		return p.node(p.col(), ind)
	}
	return p.valueBelow(ind, inMapping, line, col, false)
}

// valueBelow reads a value that starts on a later line, or is empty; props
// says the value's properties were on the indicator's line.
func (p *parser) valueBelow(ind int, inMapping bool, line, col int, props bool) (*Node, error) {
	next, err := p.nextContent()
	if err != nil {
		return nil, err
	}
	if props && next > ind && (p.src[p.pos] == '&' || p.src[p.pos] == '!') {
		return nil, p.err("properties on a line of their own before more properties are not supported")
	}
	switch {
	case next > ind && p.marker() == "":
		return p.node(next, ind)
	case next == ind && inMapping && p.src[p.pos] == '-' && p.blankAt(1):
		return p.sequence(ind)
	}
	if next >= 0 {
		p.rewindLine()
	}
	n, err := p.newNode(Scalar, line, col)
	if n != nil {
		n.Plain = true
	}
	return n, err
}

// inlineNode reads a node that is not a block collection: a flow collection,
// an alias or a scalar, starting at the position (column col). parent is the
// indentation continuation lines must exceed.
func (p *parser) inlineNode(parent, col int) (*Node, error) {
	var n *Node
	var err error
	switch c := p.src[p.pos]; c {
	case '[', '{':
		if n, err = p.flow(); err != nil {
			return nil, err
		}
	case '*':
		if n, err = p.alias(); err != nil {
			return nil, err
		}
	case '|', '>':
		return p.blockScalar(parent)
	case '"', '\'':
		if n, err = p.quoted(); err != nil {
			return nil, err
		}
	default:
		return p.plain(parent)
	}
	p.skipInline()
	if !p.eof() && p.src[p.pos] != '\n' {
		if p.src[p.pos] == ':' {
			return nil, p.err("mapping values are not allowed in this context")
		}
		return nil, p.err("unexpected character after a value")
	}
	return n, nil
}

// plain reads a block plain scalar, folding continuation lines indented more
// than parent.
func (p *parser) plain(parent int) (*Node, error) {
	switch c := p.src[p.pos]; c {
	case ',', ']', '}', '#', '%', '@', '`', '?', ':', '-':
		if (c == '?' || c == ':' || c == '-') && !p.blankAt(1) {
			break
		}
		return nil, p.err("found character that cannot start any token")
	}
	n, err := p.newNode(Scalar, p.line, p.col())
	if err != nil {
		return nil, err
	}
	n.Plain = true
	var b strings.Builder
	for {
		// One line's worth.
		start := p.pos
		end := p.pos
		for !p.eof() && p.src[p.pos] != '\n' {
			c := p.src[p.pos]
			if c == ':' && p.blankAt(1) {
				return nil, p.err("mapping values are not allowed in this context")
			}
			if c == '#' && (p.src[p.pos-1] == ' ' || p.src[p.pos-1] == '\t') {
				break
			}
			p.pos++
			if c != ' ' && c != '\t' {
				end = p.pos
			}
		}
		b.Write(p.src[start:end])
		if !p.eof() && p.src[p.pos] == '#' {
			p.skipInline()
			n.Value = b.String()
			return n, nil
		}
		// Look ahead for a continuation line.
		save, saveLine, saveStart := p.pos, p.line, p.lineStart
		breaks := 0
		cont := false
		for !p.eof() && p.src[p.pos] == '\n' {
			p.advance()
			breaks++
			for !p.eof() && (p.src[p.pos] == ' ' || p.src[p.pos] == '\t') {
				p.pos++
			}
			if p.eof() || p.src[p.pos] == '\n' {
				continue
			}
			lead := p.pos - p.lineStart
			if bytes.IndexByte(p.src[p.lineStart:p.pos], '\t') >= 0 && lead > 0 {
				// Tabs in indentation: not a continuation we read.
				break
			}
			if lead > parent && p.src[p.pos] != '#' {
				p.pos = p.lineStart + lead
				if p.marker() == "" {
					cont = true
				}
			}
			break
		}
		if !cont {
			p.pos, p.line, p.lineStart = save, saveLine, saveStart
			n.Value = b.String()
			return n, nil
		}
		if breaks == 1 {
			b.WriteByte(' ')
		} else {
			b.WriteString(strings.Repeat("\n", breaks-1))
		}
	}
}

// quoted reads a single- or double-quoted scalar.
func (p *parser) quoted() (*Node, error) {
	n, err := p.newNode(Scalar, p.line, p.col())
	if err != nil {
		return nil, err
	}
	q := p.src[p.pos]
	line, col := p.line, p.col()
	p.pos++
	var b strings.Builder
	for {
		if p.eof() {
			return nil, p.errAt(line, col, "unterminated quoted scalar")
		}
		c := p.src[p.pos]
		switch {
		case c == q && q == '\'' && p.peek(1) == '\'':
			b.WriteByte('\'')
			p.pos += 2
		case c == q:
			p.pos++
			n.Value = b.String()
			return n, nil
		case c == '\\' && q == '"':
			if p.peek(1) == '\n' {
				p.pos++
				p.advance()
				for !p.eof() && (p.src[p.pos] == ' ' || p.src[p.pos] == '\t') {
					p.pos++
				}
				continue
			}
			if err := p.escape(&b); err != nil {
				return nil, err
			}
		case c == ' ' || c == '\t' || c == '\n':
			// Whitespace runs: kept inside a line, folded across lines.
			start := p.pos
			for !p.eof() && (p.src[p.pos] == ' ' || p.src[p.pos] == '\t') {
				p.pos++
			}
			if p.eof() || p.src[p.pos] != '\n' {
				b.Write(p.src[start:p.pos])
				continue
			}
			breaks := 0
			for !p.eof() && (p.src[p.pos] == '\n' || p.src[p.pos] == ' ' || p.src[p.pos] == '\t') {
				if p.src[p.pos] == '\n' {
					breaks++
				}
				p.advance()
			}
			if p.marker() != "" {
				return nil, p.err("document marker inside a quoted scalar")
			}
			if breaks == 1 {
				b.WriteByte(' ')
			} else {
				b.WriteString(strings.Repeat("\n", breaks-1))
			}
		default:
			b.WriteByte(c)
			p.pos++
		}
	}
}

func (p *parser) escape(b *strings.Builder) error {
	line, col := p.line, p.col()
	p.pos++ // the backslash
	if p.eof() {
		return p.errAt(line, col, "unterminated escape")
	}
	c := p.src[p.pos]
	p.pos++
	simple := map[byte]string{'0': "\x00", 'a': "\a", 'b': "\b", 't': "\t", '\t': "\t", 'n': "\n", 'v': "\v", 'f': "\f",
		'r': "\r", 'e': "\x1b", ' ': " ", '"': "\"", '/': "/", '\\': "\\", 'N': "\u0085", '_': "\u00a0", 'L': "\u2028", 'P': "\u2029"}
	if s, ok := simple[c]; ok {
		b.WriteString(s)
		return nil
	}
	width := map[byte]int{'x': 2, 'u': 4, 'U': 8}[c]
	if width == 0 || p.pos+width > len(p.src) {
		return p.errAt(line, col, "unknown escape")
	}
	v, err := strconv.ParseUint(string(p.src[p.pos:p.pos+width]), 16, 32)
	if err != nil || !utf8.ValidRune(rune(v)) {
		return p.errAt(line, col, "invalid escape")
	}
	p.pos += width
	b.WriteRune(rune(v))
	return nil
}

// blockScalar reads a literal "|" or folded ">" scalar whose content is
// indented more than parent.
func (p *parser) blockScalar(parent int) (*Node, error) {
	n, err := p.newNode(Scalar, p.line, p.col())
	if err != nil {
		return nil, err
	}
	folded := p.src[p.pos] == '>'
	p.pos++
	chomp, explicit := p.blockIndicators()
	if !p.blankAt(0) || !p.atLineEnd() {
		return nil, p.err("expected the end of the line after a block scalar indicator")
	}
	base := parent
	if base < 0 {
		base = 0
	}
	indent := -1
	if explicit > 0 {
		indent = base + explicit
		if parent < 0 {
			indent = explicit
		}
	}
	lines, indent, endsWithBreak := p.blockLines(base, indent)
	n.Value = joinBlock(lines, indent, folded, chomp, endsWithBreak)
	return n, nil
}

// blockIndicators reads a block scalar's chomping ('+', '-' or 0) and
// explicit indentation (0 for none) after its '|' or '>'.
func (p *parser) blockIndicators() (chomp byte, explicit int) {
	for i := 0; i < 2 && !p.eof(); i++ {
		switch c := p.src[p.pos]; {
		case (c == '+' || c == '-') && chomp == 0:
			chomp = c
		case c >= '1' && c <= '9' && explicit == 0:
			explicit = int(c - '0')
		default:
			return chomp, explicit
		}
		p.pos++
	}
	return chomp, explicit
}

// blockLines reads a block scalar's lines, indented deeper than base (by
// indent when it is known, else by the first content line's), with the
// indentation removed ("" for an empty line). It returns the indentation
// found, and whether the last line read ended with a line break.
func (p *parser) blockLines(base, indent int) (lines []string, _ int, endsWithBreak bool) {
	for !p.eof() {
		// p.pos is at a '\n' ending the previous line; one that ends the
		// input starts no line.
		if p.pos+1 >= len(p.src) {
			break
		}
		save, saveLine, saveStart := p.pos, p.line, p.lineStart
		p.advance()
		lead := 0
		for !p.eof() && p.src[p.pos] == ' ' && (indent < 0 || lead < indent) {
			p.pos++
			lead++
		}
		rest := p.pos
		for rest < len(p.src) && p.src[rest] != '\n' {
			rest++
		}
		text := string(p.src[p.pos:rest])
		empty := strings.Trim(text, " ") == "" && (indent < 0 || lead < indent)
		if rest == len(p.src) && text == "" {
			p.pos = rest
			break // a blank last line without a line break adds nothing
		}
		if empty && !strings.Contains(text, "\t") {
			if indent >= 0 && lead >= indent {
				lines = append(lines, text)
			} else {
				lines = append(lines, "")
			}
			p.pos = rest
			endsWithBreak = rest < len(p.src)
			continue
		}
		if indent < 0 {
			if lead <= base {
				p.pos, p.line, p.lineStart = save, saveLine, saveStart
				break
			}
			indent = lead
		}
		if lead < indent || p.marker() != "" {
			p.pos, p.line, p.lineStart = save, saveLine, saveStart
			break
		}
		lines = append(lines, text)
		p.pos = rest
		endsWithBreak = rest < len(p.src)
	}
	return lines, indent, endsWithBreak
}

// joinBlock makes a block scalar's value of its lines: literal or folded,
// with its chomping of the trailing line breaks.
func joinBlock(lines []string, indent int, folded bool, chomp byte, endsWithBreak bool) string {
	// Trailing empty lines are chomping's business.
	trailing := 0
	for len(lines) > 0 && strings.TrimLeft(lines[len(lines)-1], " ") == "" && !(indent >= 0 && len(lines[len(lines)-1]) > 0) {
		lines = lines[:len(lines)-1]
		trailing++
	}
	var b strings.Builder
	pending, prevMore, first := 0, false, true
	for _, l := range lines {
		if l == "" {
			pending++
			continue
		}
		more := l[0] == ' ' || l[0] == '\t'
		switch {
		case first:
			b.WriteString(strings.Repeat("\n", pending))
		case folded && !more && !prevMore:
			if pending == 0 {
				b.WriteByte(' ')
			} else {
				b.WriteString(strings.Repeat("\n", pending))
			}
		default:
			b.WriteString(strings.Repeat("\n", pending+1))
		}
		b.WriteString(l)
		pending, prevMore, first = 0, more, false
	}
	trailing += pending
	switch {
	case first: // no content
		if chomp == '+' {
			b.WriteString(strings.Repeat("\n", trailing+boolInt(endsWithBreak && trailing == 0)))
		}
	case chomp == '-':
	case chomp == '+':
		b.WriteString(strings.Repeat("\n", trailing+boolInt(endsWithBreak || trailing > 0)))
	default:
		if endsWithBreak || trailing > 0 {
			b.WriteByte('\n')
		}
	}
	return b.String()
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// skipFlowSpace skips whitespace, line ends and comments inside a flow
// collection.
func (p *parser) skipFlowSpace() error {
	for !p.eof() {
		switch p.src[p.pos] {
		case ' ', '\t':
			p.pos++
		case '\n':
			p.advance()
			if p.marker() != "" {
				return p.err("document marker inside a flow collection")
			}
		case '#':
			start := p.pos
			if p.skipInline(); p.pos == start {
				return nil // not a comment: the caller refuses the '#'
			}
		default:
			return nil
		}
	}
	return nil
}

// flow reads a flow mapping or sequence (and so JSON).
func (p *parser) flow() (*Node, error) {
	if err := p.enter(); err != nil {
		return nil, err
	}
	defer func() { p.depth-- }()
	line, col := p.line, p.col()
	kind, closer := Sequence, byte(']')
	if p.src[p.pos] == '{' {
		kind, closer = Mapping, '}'
	}
	n, err := p.newNode(kind, line, col)
	if err != nil {
		return nil, err
	}
	p.pos++
	for {
		if err := p.skipFlowSpace(); err != nil {
			return nil, err
		}
		if p.eof() {
			return nil, p.errAt(line, col, "unterminated flow collection")
		}
		if p.src[p.pos] == closer {
			p.pos++
			return n, nil
		}
		if kind == Mapping && p.src[p.pos] == '?' && p.blankAt(1) {
			return nil, p.err("complex keys are not supported")
		}
		if kind == Mapping && (p.src[p.pos] == '[' || p.src[p.pos] == '{') {
			return nil, p.err("collection keys are not supported")
		}
		item, err := p.flowNode()
		if err != nil {
			return nil, err
		}
		if err := p.skipFlowSpace(); err != nil {
			return nil, err
		}
		if p.eof() {
			return nil, p.errAt(line, col, "unterminated flow collection")
		}
		if p.src[p.pos] == ':' {
			if kind == Sequence {
				return nil, p.err("mappings inside flow sequences are not supported")
			}
			p.pos++
			if err := p.skipFlowSpace(); err != nil {
				return nil, err
			}
			var val *Node
			if c := p.peek(0); c == ',' || c == '}' {
				if val, err = p.newNode(Scalar, p.line, p.col()); err != nil {
					return nil, err
				}
				val.Plain = true
			} else if val, err = p.flowNode(); err != nil {
				return nil, err
			}
			n.Content = append(n.Content, item, val)
		} else if kind == Mapping {
			val, err := p.newNode(Scalar, p.line, p.col())
			if err != nil {
				return nil, err
			}
			val.Plain = true
			n.Content = append(n.Content, item, val)
		} else {
			n.Content = append(n.Content, item)
		}
		if err := p.skipFlowSpace(); err != nil {
			return nil, err
		}
		if p.eof() {
			return nil, p.errAt(line, col, "unterminated flow collection")
		}
		switch p.src[p.pos] {
		case ',':
			p.pos++
		case closer:
		default:
			return nil, p.err("expected ',' or '%c'", closer)
		}
	}
}

// flowNode reads one node inside a flow collection.
func (p *parser) flowNode() (*Node, error) {
	line, col := p.line, p.col()
	anchor, tag, err := p.properties()
	if err != nil {
		return nil, err
	}
	if err := p.skipFlowSpace(); err != nil {
		return nil, err
	}
	var n *Node
	switch c := p.peek(0); c {
	case '[', '{':
		n, err = p.flow()
	case '*':
		n, err = p.alias()
	case '"', '\'':
		n, err = p.quoted()
	case ',', ']', '}', ':', 0:
		if anchor == "" && tag == "" && c != ':' {
			return nil, p.err("expected a value")
		}
		if n, err = p.newNode(Scalar, p.line, p.col()); n != nil {
			n.Plain = true
		}
	default:
		n, err = p.flowPlain()
	}
	if err != nil {
		return nil, err
	}
	return p.finish(n, anchor, tag, line, col)
}

// flowPlain reads a plain scalar inside a flow collection, on one line.
func (p *parser) flowPlain() (*Node, error) {
	switch c := p.src[p.pos]; c {
	case '#', '%', '@', '`', '|', '>', '&', '!', '?', '-':
		if (c == '?' || c == '-') && !p.blankAt(1) && !strings.ContainsRune(",[]{}", rune(p.peek(1))) {
			break
		}
		return nil, p.err("found character that cannot start any token")
	}
	n, err := p.newNode(Scalar, p.line, p.col())
	if err != nil {
		return nil, err
	}
	n.Plain = true
	start, end := p.pos, p.pos
	for !p.eof() {
		c := p.src[p.pos]
		if c == '\n' || strings.IndexByte(",[]{}", c) >= 0 {
			break
		}
		if c == ':' && p.blankAt(1) {
			break
		}
		if c == ':' && strings.IndexByte(",[]{}", p.peek(1)) >= 0 {
			// YAML implementations disagree on whether this ends the scalar.
			return nil, p.err("':' right before a flow indicator is ambiguous")
		}
		if c == '#' && (p.src[p.pos-1] == ' ' || p.src[p.pos-1] == '\t') {
			break
		}
		p.pos++
		if c != ' ' && c != '\t' {
			end = p.pos
		}
	}
	n.Value = string(p.src[start:end])
	return n, nil
}
