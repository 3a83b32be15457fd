// Command ociimage writes the konnectivity agent container image as an OCI
// image layout tarball, without a registry or a Docker daemon:
//
//	go run ./images/ociimage -bin bin/konnectivity -tag spinifex/konnectivity-agent:V \
//	    -version V -revision R -out bin/konnectivity-agent-image.tar
//
// The archive is what containerd imports (`ctr images import`, and k3s from
// /var/lib/rancher/k3s/agent/images/*.tar at start): oci-layout, index.json
// naming the image, blobs/sha256/ with the manifest, config and one gzip
// layer, and a Docker-style manifest.json beside them for older importers.
// The layer holds the static binary as /usr/local/bin/konnectivity (with the
// konnectivity-agent symlink) and /etc/passwd and /etc/group entries for the
// non-root user the image runs as.
//
// The output is reproducible: the same inputs give the same bytes. Every
// timestamp is SOURCE_DATE_EPOCH (default 0), owners are 0:0, entries are
// sorted, tar headers are plain ustar (no PAX times) and gzip stores no name
// or time. It is a build tool, not part of the konnectivity binary.
package main
