package yamlnode

import (
	"strings"
	"testing"
)

// tree renders a node compactly: scalars quoted (~ for null), mappings as
// {k:v,...}, sequences as [a,...].
func tree(n *Node) string {
	if n == nil {
		return "<nil>"
	}
	switch n.Kind {
	case Mapping:
		parts := make([]string, 0, len(n.Content)/2)
		for i := 0; i+1 < len(n.Content); i += 2 {
			parts = append(parts, tree(n.Content[i])+":"+tree(n.Content[i+1]))
		}
		return "{" + strings.Join(parts, ",") + "}"
	case Sequence:
		parts := make([]string, 0, len(n.Content))
		for _, c := range n.Content {
			parts = append(parts, tree(c))
		}
		return "[" + strings.Join(parts, ",") + "]"
	}
	if n.IsNull() {
		return "~"
	}
	return "'" + n.Value + "'"
}

func TestParse(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"block mapping", "a: b\nc: d\n", "{'a':'b','c':'d'}"},
		{"nested", "a:\n  b: c\n  d:\n    e: f\ng: h\n", "{'a':{'b':'c','d':{'e':'f'}},'g':'h'}"},
		{"sequence", "- a\n- b\n", "['a','b']"},
		{"sequence of mappings", "- name: a\n  v: 1\n- name: b\n", "[{'name':'a','v':'1'},{'name':'b'}]"},
		{"sequence at key indent", "a:\n- b\n- c\nd: e\n", "{'a':['b','c'],'d':'e'}"},
		{"indented sequence", "a:\n  - b\n  - c\n", "{'a':['b','c']}"},
		{"compact nested sequence", "- - a\n  - b\n- c\n", "[['a','b'],'c']"},
		{"empty values", "a:\nb: ~\nc: null\nd: ''\n-x: \"\"\n", "{'a':~,'b':~,'c':~,'d':'','-x':''}"},
		{"empty item", "-\n- x\n", "[~,'x']"},
		{"plain with colons", "a: https://h:6443/p#f\nb: a:b\n", "{'a':'https://h:6443/p#f','b':'a:b'}"},
		{"comments", "# top\na: b # trailing\n# between\nc: d\n", "{'a':'b','c':'d'}"},
		{"plain folding", "a: one\n  two\n\n  three\n", "{'a':'one two\nthree'}"},
		{"single quoted", "a: 'it''s # not a comment'\n", "{'a':'it's # not a comment'}"},
		{"double quoted escapes", `a: "\t\n\\\"\x41\u00e9\U0001F600\/\0"` + "\n", "{'a':'\t\n\\\"Aé😀/\x00'}"},
		{"double quoted folding", "a: \"x\n  y\n\n  z\"\n", "{'a':'x y\nz'}"},
		{"escaped line break", "a: \"x\\\n  y\"\n", "{'a':'xy'}"},
		{"quoted key", "'a b': c\n\"d\": e\n", "{'a b':'c','d':'e'}"},
		{"literal", "a: |\n  x\n   y\n\n  z\nb: c\n", "{'a':'x\n y\n\nz\n','b':'c'}"},
		{"literal strip", "a: |-\n  x\n\n", "{'a':'x'}"},
		{"literal keep", "a: |+\n  x\n\n", "{'a':'x\n\n'}"},
		{"literal indicator", "a: |2\n    x\n", "{'a':'  x\n'}"},
		{"folded", "a: >\n  x\n  y\n\n  z\n    w\n  v\n", "{'a':'x y\nz\n  w\nv\n'}"},
		{"folded strip", "a: >-\n  x\n  y\n", "{'a':'x y'}"},
		{"block scalar in sequence", "- |\n  x\n- y\n", "['x\n','y']"},
		{"flow", "a: {b: c, 'd': \"e\", f: [g, h], i: {}, j: []}\n", "{'a':{'b':'c','d':'e','f':['g','h'],'i':{},'j':[]}}"},
		{"flow multiline", "a: [b,\n  c, # comment\n  d]\n", "{'a':['b','c','d']}"},
		{"flow key without value", "{a, b: c}", "{'a':~,'b':'c'}"},
		{"json", `{"a":{"b":[1,true,null,"x"]},"c":""}`, "{'a':{'b':['1','true',~,'x']},'c':''}"},
		{"document markers", "---\na: b\n...\n", "{'a':'b'}"},
		{"document marker with value", "--- [a]\n", "['a']"},
		{"crlf", "a: b\r\nc:\r\n- d\r\n", "{'a':'b','c':['d']}"},
		{"bom", "\ufeffa: b\n", "{'a':'b'}"},
		{"aliases", "a: &x {b: c}\nd: *x\n", "{'a':{'b':'c'},'d':{'b':'c'}}"},
		{"anchored block", "a: &x\n  b: c\nd: *x\n", "{'a':{'b':'c'},'d':{'b':'c'}}"},
		{"tags", "a: !!str null\nb: !!null ''\n", "{'a':'null','b':~}"},
		{"duplicate keys kept", "a: 1\na: 2\n", "{'a':'1','a':'2'}"},
		{"tab after value", "a:\tb\n", "{'a':'b'}"},
		{"lone CR", "a: b\rc: d\r", "{'a':'b','c':'d'}"},
		{"marker only", "---\n", "~"},
		{"keep without final break", "a: |+\n  x\n  ", "{'a':'x\n'}"},
		{"empty", "", "<nil>"},
		{"comments only", "# x\n\n", "<nil>"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, err := Parse([]byte(tc.in))
			if err != nil {
				t.Fatalf("%q: %v", tc.in, err)
			}
			if got := tree(n); got != tc.want {
				t.Errorf("%q:\ngot  %s\nwant %s", tc.in, got, tc.want)
			}
		})
	}
}

func TestPositions(t *testing.T) {
	n, err := Parse([]byte("a:\n  - x\nb: {c: 'd'}\n"))
	if err != nil {
		t.Fatal(err)
	}
	seq, flow := n.Content[1], n.Content[3]
	if seq.Line != 2 || seq.Column != 3 || flow.Line != 3 || flow.Column != 4 || flow.Content[1].Column != 8 {
		t.Errorf("positions: seq %d:%d flow %d:%d value col %d", seq.Line, seq.Column, flow.Line, flow.Column, flow.Content[1].Column)
	}
	if n.Content[1].Content[0].Plain != true || flow.Content[1].Plain {
		t.Error("Plain not recorded")
	}
}

// Every refusal names a line and a column, and never echoes the input.
func TestRefusals(t *testing.T) {
	const secret = "s3cr3t"
	for _, tc := range []struct{ name, in, want string }{
		{"tab indentation", "a:\n\tb: " + secret + "\n", "line 2: found character that cannot start any token"},
		{"several documents", "a: " + secret + "\n---\nb: c\n", "line 2: several documents are not supported at column 1"},
		{"directive", "%YAML 1.2\n---\na: " + secret + "\n", "line 1: directives are not supported"},
		{"complex key", "? " + secret + "\n: b\n", "line 1: complex keys are not supported"},
		{"flow collection key", "{[" + secret + "]: b}\n", "line 1: collection keys are not supported at column 2"},
		{"custom tag", "a: !foo " + secret + "\n", "line 1: only the standard !! tags are supported at column 4"},
		{"verbatim tag", "a: !<tag:yaml.org,2002:str> " + secret + "\n", "only the standard !! tags"},
		{"unknown alias", "a: *" + secret + "\n", "line 1: unknown anchor at column 4"},
		{"self alias", "a: &" + secret + " [*" + secret + "]\n", "unknown anchor"},
		{"properties on key", "- &a " + secret + ": x\n", "properties on a mapping key"},
		{"unterminated quote", "a: \"" + secret + "\n", "line 1: unterminated quoted scalar at column 4"},
		{"unterminated flow", "current-context: [\n", "line 1: unterminated flow collection at column 18"},
		{"bad indentation", "a: b\n  c: " + secret + "\n", "line 2: mapping values are not allowed"},
		{"value then key", "a: b: " + secret + "\n", "line 1: mapping values are not allowed"},
		{"sequence in mapping value", "a: - " + secret + "\n", "block sequence entries are not allowed"},
		{"bad escape", `a: "\q` + secret + `"`, "line 1: unknown escape at column 5"},
		{"junk after flow", "a: [b] " + secret + "\n", "unexpected character after a value"},
		{"flow pair in sequence", "[a: " + secret + "]\n", "mappings inside flow sequences"},
		{"too deep flow", "a: " + strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1), "nested deeper than 64"},
		{"too deep block", deepBlock(MaxDepth + 1), "nested deeper than 64"},
		{"missing key", "a: b\n- " + secret + "\n", "a sequence entry is not allowed here"},
		{"not UTF-8", "a: " + secret + "\n\xff\xfe", "line 2: not valid UTF-8 at column 1"},
		{"UTF-16", "\xff\xfea\x00", "line 1: not valid UTF-8 at column 1"},
		{"ambiguous colon", "{" + secret + ":}", "':' right before a flow indicator is ambiguous"},
		{"bad anchor name", "a: &" + secret + ":x y\n", "an anchor name must be"},
		{"properties on marker line", "--- &a " + secret + "\n", "properties on the document marker line"},
		{"properties twice", "a: &a\n  &b " + secret + "\n", "before more properties"},
		{"anchor twice", "a: &x b\nc: &x {d: *x}\n", "line 2: anchor defined twice at column 4"},
		{"hash in flow", "[#" + secret + "]", "found character that cannot start any token"},
		{"block indicator junk", "a: |x " + secret + "\n", "expected the end of the line after a block scalar indicator"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n, err := Parse([]byte(tc.in))
			if err == nil {
				t.Fatalf("accepted %q as %s", tc.in, tree(n))
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%q: error %q does not contain %q", tc.in, err, tc.want)
			}
			if strings.Contains(err.Error(), secret) {
				t.Errorf("error echoes the input: %v", err)
			}
			if !strings.Contains(err.Error(), "line ") || !strings.Contains(err.Error(), " at column ") {
				t.Errorf("error names no position: %v", err)
			}
		})
	}
}

func deepBlock(n int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString(strings.Repeat(" ", i) + "k:\n")
	}
	return b.String()
}

// MaxDepth itself is accepted.
func TestDepthLimit(t *testing.T) {
	if _, err := Parse([]byte(deepBlock(MaxDepth))); err != nil {
		t.Errorf("block at MaxDepth: %v", err)
	}
	if _, err := Parse([]byte(strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth))); err != nil {
		t.Errorf("flow at MaxDepth: %v", err)
	}
}

// Aliases share the anchored node, so many aliases cost nothing.
func TestAliasesShareNodes(t *testing.T) {
	n, err := Parse([]byte("a: &a [x, y]\nb: [*a, *a, *a]\n"))
	if err != nil {
		t.Fatal(err)
	}
	if b := n.Content[3]; b.Content[0] != n.Content[1] || b.Content[2] != n.Content[1] {
		t.Error("alias is a copy")
	}
}
