//go:build !unix

package certs

import "io/fs"

// inode is unavailable here; modification time and size still detect changes.
func inode(fs.FileInfo) uint64 { return 0 }
