#!/bin/sh
# Build the konnectivity overlay of the EKS node image: a tarball to unpack
# onto / (e.g. `tar -xzpf overlay.tar.gz -C /`).
#
#   images/build-overlay.sh OUT.tar.gz BIN [AGENT_IMAGE.tar]
#
# Contents: images/eks-node/ (k3s configuration, agent manifest, first-boot
# example), the binary BIN as /usr/local/bin/konnectivity with its upstream
# names as symlinks, and the OpenRC files copied from openrc/ (kept there once,
# not duplicated under images/).
#
# The agent DaemonSet runs the agent image. AGENT_IMAGE.tar (third argument,
# or $AGENT_IMAGE), the OCI archive `make agent-image` writes, goes to
# /var/lib/rancher/k3s/agent/images/konnectivity-agent.tar, which k3s imports
# into containerd at start; the manifest's @VERSION@ becomes the archive's
# tag, and the build fails unless the archive names exactly the image the
# manifest references. Without an archive, $AGENT_IMAGE_VERSION gives the tag
# to pull from the registry instead.
#
# Reproducible: the same inputs give the same bytes. Entries are sorted by
# name, owned by 0:0, dated SOURCE_DATE_EPOCH (default 0), modes are set
# explicitly (0755 binary and init scripts, 0644 configuration), and gzip
# stores no name or time. Directory entries exist only for directories this
# overlay owns, so unpacking leaves /etc, /usr/local/bin and the like alone.
set -eu

if [ $# != 2 ] && [ $# != 3 ]; then
	echo "usage: $0 OUT.tar.gz BIN [AGENT_IMAGE.tar]" >&2
	exit 2
fi
out=$1
bin=$2
image=${3:-${AGENT_IMAGE:-}}
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

# The image the manifest runs, up to the tag: "docker.io/x/y:" from
# "        image: docker.io/x/y:@VERSION@".
manifest=var/lib/rancher/k3s/server/manifests/konnectivity-agent.yaml
repo=$(sed -n 's/^ *image: \(.*:\)@VERSION@$/\1/p' "$tree/$manifest")
if [ "$(printf '%s\n' "$repo" | grep -c .)" != 1 ]; then
	echo "$0: $manifest needs exactly one 'image: NAME:@VERSION@' line" >&2
	exit 1
fi
if [ -n "$image" ]; then
	if [ ! -f "$image" ]; then
		echo "$0: agent image $image is not a file (run make agent-image)" >&2
		exit 1
	fi
	# The name containerd gives the image on import (compact JSON, as
	# images/ociimage writes it).
	names=$(tar -xOf "$image" index.json 2>/dev/null |
		grep -o '"io.containerd.image.name":"[^"]*"' | sed 's/.*:"\(.*\)"$/\1/') || true
	if [ "$(printf '%s\n' "$names" | grep -c .)" != 1 ]; then
		echo "$0: $image: want one io.containerd.image.name in index.json, found: ${names:-none}" >&2
		exit 1
	fi
	case $names in
	"$repo"?*) version=${names#"$repo"} ;;
	*)
		echo "$0: $image is $names, but $manifest runs $repo<tag>" >&2
		exit 1
		;;
	esac
elif [ -n "${AGENT_IMAGE_VERSION:-}" ]; then
	version=$AGENT_IMAGE_VERSION
else
	echo "$0: give the agent image archive (make agent-image) as the third argument or \$AGENT_IMAGE," >&2
	echo "    or set AGENT_IMAGE_VERSION to the tag of ${repo%:} to pull" >&2
	exit 1
fi
case $version in
*[!A-Za-z0-9_.-]* | [.-]*)
	echo "$0: image tag '$version' is not a valid tag" >&2
	exit 1
	;;
esac

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
# The manifest names the exact tag (IfNotPresent then never pulls).
sed "s/@VERSION@/$version/" "$tree/$manifest" >"$stage/$manifest"
if grep -q @VERSION@ "$stage/$manifest"; then
	echo "$0: @VERSION@ left in $manifest" >&2
	exit 1
fi
images_dir=var/lib/rancher/k3s/agent/images
if [ -n "$image" ]; then
	put "$image" "$images_dir/konnectivity-agent.tar" 0644
fi
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
# k3s's own agent/ directory is left alone (tar creates it only if missing);
# the images folder in it is where an air-gapped node's images go.
if [ -n "$image" ]; then
	owned_dirs="$owned_dirs$images_dir 0755
"
fi
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
