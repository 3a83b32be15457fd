// Package yamlnode reads the subset of YAML that kubeconfig files are written
// in into a tree of nodes, so that the binary need not carry a full YAML
// implementation (and the regexp package it pulls in) for one file format.
//
// What it reads: one document, optionally opened by "---" and closed by
// "..."; block mappings and sequences by indentation, including "- key: v"
// items and a sequence at the same indentation as its key, as kubectl writes
// them; plain, single-quoted and double-quoted scalars (with YAML's escapes
// and line folding); literal "|" and folded ">" block scalars with chomping
// and indentation indicators; flow mappings and sequences, so JSON reads too;
// comments; anchors and aliases (an alias is the anchored node itself, never
// a copy, so no input can make the tree grow beyond the node bound); the
// standard "!!" tags; CRLF line ends and a UTF-8 byte order mark.
//
// What it refuses, with an error naming line and column and never a value:
// several documents, directives, tags other than the standard ones, complex
// ("?") and collection keys, tabs as indentation, properties on implicit
// keys, input that is not UTF-8, an anchor defined twice and a ':' right
// before a flow indicator (YAML implementations disagree on what these
// mean), and anything else it does not understand. Refusing is always safe:
// a kubeconfig the reader cannot read is reported, never half-read.
//
// Duplicate keys are kept, in order, as yaml.v3's node API keeps them: the
// caller knows which mapping it is reading and can name it in the error.
//
// Bounds: nesting depth is at most MaxDepth and the number of nodes at most
// proportional to the input, so a hostile file costs time and memory linear
// in its size. The caller bounds the input size.
package yamlnode
