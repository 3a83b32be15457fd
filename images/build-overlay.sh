#!/bin/sh
# Build the konnectivity overlay of the EKS node image: a tarball to unpack
# onto / (e.g. `tar -xzpf overlay.tar.gz -C /`).
#
#   images/build-overlay.sh OUT.tar.gz BIN
#
# Contents: images/eks-node/ (k3s configuration, agent manifest, first-boot
# example), the binary BIN as /usr/local/bin/konnectivity with its upstream
# names as symlinks, and the OpenRC files copied from openrc/ (kept there once,
# not duplicated under images/).
#
# Reproducible: the same inputs give the same bytes. Entries are sorted by
# name, owned by 0:0, dated SOURCE_DATE_EPOCH (default 0), modes are set
# explicitly (0755 binary and init scripts, 0644 configuration), and gzip
# stores no name or time. Directory entries exist only for directories this
# overlay owns, so unpacking leaves /etc, /usr/local/bin and the like alone.
set -eu

if [ $# != 2 ]; then
	echo "usage: $0 OUT.tar.gz BIN" >&2
	exit 2
fi
out=$1
bin=$2
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
tree=$here/eks-node
epoch=${SOURCE_DATE_EPOCH:-0}

if [ ! -f "$bin" ] || [ ! -x "$bin" ]; then
	echo "$0: $bin is not an executable file (run make build)" >&2
	exit 1
fi
tar --version 2>/dev/null | grep -q 'GNU tar' || {
	echo "$0: needs GNU tar (--sort=name)" >&2
	exit 1
}

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
umask 022

# put SRC DEST MODE: copy one file into the stage with an explicit mode.
put() {
	mkdir -p "$stage/$(dirname "$2")"
	cp "$1" "$stage/$2"
	chmod "$3" "$stage/$2"
}

# The tree from git; every file there is configuration (0644).
(cd "$tree" && find . -type f) | LC_ALL=C sort | while read -r f; do
	put "$tree/$f" "${f#./}" 0644
done
put "$bin" usr/local/bin/konnectivity 0755
for name in konnectivity-server konnectivity-agent eks-konnectivity-cert; do
	ln -s konnectivity "$stage/usr/local/bin/$name"
done
for svc in konnectivity-server konnectivity-agent; do
	put "$root/openrc/$svc.initd" "etc/init.d/$svc" 0755
	put "$root/openrc/$svc.confd" "etc/conf.d/$svc" 0644
done

# Directories the overlay owns, with their modes; k3s keeps its server state
# private (0700), as it would create it.
owned_dirs="
etc/rancher 0755
etc/rancher/k3s 0755
etc/rancher/k3s/config.yaml.d 0755
etc/spinifex-eks 0755
var/lib/rancher 0755
var/lib/rancher/k3s 0755
var/lib/rancher/k3s/server 0700
var/lib/rancher/k3s/server/manifests 0700
"
list=$stage.list
trap 'rm -rf "$stage" "$list"' EXIT
printf '%s\n' "$owned_dirs" | while read -r d mode; do
	[ -n "$d" ] || continue
	[ -d "$stage/$d" ] || {
		echo "$0: owned directory $d is not in the tree" >&2
		exit 1
	}
	chmod "$mode" "$stage/$d"
	echo "$d"
done >"$list"
(cd "$stage" && find . ! -type d | sed 's|^\./||') >>"$list"
LC_ALL=C sort -o "$list" "$list"

mkdir -p "$(dirname "$out")"
tar -C "$stage" --format=gnu --no-recursion --sort=name \
	--mtime="@$epoch" --owner=0 --group=0 --numeric-owner \
	-cf - -T "$list" | gzip -n -9 >"$out.tmp"
mv -f "$out.tmp" "$out"
echo "wrote $out ($(wc -c <"$out") bytes)"
