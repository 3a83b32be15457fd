package yamlnode

import "testing"

// FuzzParse checks that no input panics the reader, and that what it returns
// respects the bounds: depth at most MaxDepth and nodes proportional to the
// input. Seeds are in testdata/fuzz/FuzzParse and run with every go test.
func FuzzParse(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		n, err := Parse(data)
		if err != nil {
			if n != nil {
				t.Fatal("a node and an error")
			}
			return
		}
		seen := map[*Node]bool{}
		count := 0
		var walk func(n *Node, depth int)
		walk = func(n *Node, depth int) {
			if n == nil || seen[n] {
				return
			}
			seen[n] = true
			count++
			if n.Kind != Scalar && depth > MaxDepth {
				t.Fatalf("depth %d", depth)
			}
			if n.Line < 1 || n.Column < 1 {
				t.Fatalf("position %d:%d", n.Line, n.Column)
			}
			for _, c := range n.Content {
				walk(c, depth+1)
			}
		}
		walk(n, 1)
		if count > 2*len(data)+16 {
			t.Fatalf("%d nodes from %d bytes", count, len(data))
		}
	})
}
