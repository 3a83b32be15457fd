#!/bin/sh
# shellcheck shell=sh disable=SC2015
# Test of images/build-overlay.sh: two builds are byte-identical, and the
# unpacked tarball has exactly the expected paths, modes, owners and symlinks.
# Uses $KONNECTIVITY_BIN, else bin/konnectivity, else a stand-in executable;
# and the agent image archive $AGENT_IMAGE, else one built from that binary
# with images/ociimage (not possible for the stand-in: then the overlay is
# built without an image and the image checks are skipped with a note).
# The last line is "N passed, N failed"; exit status non-zero on any failure.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
PASSES=0 FAILS=0
ok() {
	echo "ok: $*"
	PASSES=$((PASSES + 1))
}
fail() {
	echo "FAIL: $*"
	FAILS=$((FAILS + 1))
}
check() {
	_d=$1
	shift
	if "$@"; then ok "$_d"; else fail "$_d"; fi
}

work=$(mktemp -d)
cpid=
cleanup() {
	# A containerd started below: stop it, and drop any mount it left.
	if [ -n "$cpid" ]; then
		kill "$cpid" 2>/dev/null || true
		wait "$cpid" 2>/dev/null || true
		awk -v p="$work/" 'index($2, p) == 1 {print $2}' /proc/mounts | sort -r |
			while read -r mnt; do umount -l "$mnt" || true; done
	fi
	rm -rf "$work"
}
trap cleanup EXIT
bin=${KONNECTIVITY_BIN:-$root/bin/konnectivity}
if [ ! -x "$bin" ]; then
	bin=$work/konnectivity
	printf '#!/bin/sh\necho stand-in konnectivity\n' >"$bin"
	chmod 755 "$bin"
	echo "note: $root/bin/konnectivity missing, using a stand-in binary"
fi
repo=docker.io/spinifex/konnectivity-agent
image=${AGENT_IMAGE:-}
if [ -z "$image" ] && [ "$bin" != "$work/konnectivity" ]; then
	image=$work/agent-image.tar
	if (cd "$root" && go run ./images/ociimage -bin "$bin" -tag "$repo:v0.0.0-test-images" \
		-version v0.0.0-test-images -revision test -out "$image" >/dev/null); then
		ok "agent image built with images/ociimage"
	else
		fail "agent image built with images/ociimage"
		image=
	fi
fi
if [ -n "$image" ]; then
	# Builds get the archive as the third argument (and once via $AGENT_IMAGE).
	arg3=$image
	unset AGENT_IMAGE_VERSION
	tag=$(tar -xOf "$image" index.json | grep -o '"io.containerd.image.name":"[^"]*"' | sed 's/.*:"\(.*\)"$/\1/')
else
	echo "note: no agent image; building with AGENT_IMAGE_VERSION=stand-in, image checks skipped"
	arg3=
	export AGENT_IMAGE_VERSION=stand-in
	tag=$repo:stand-in
fi
unset AGENT_IMAGE

# Two builds from different temp dirs and umasks must give the same bytes.
if (cd / && umask 022 && TMPDIR=$work "$here/build-overlay.sh" "$work/a/overlay.tar.gz" "$bin" ${arg3:+"$arg3"} >/dev/null); then
	ok "build 1"
else
	fail "build 1"
fi
mkdir -p "$work/tmp2"
if (cd "$work" && umask 077 && TMPDIR=$work/tmp2 AGENT_IMAGE=$arg3 "$here/build-overlay.sh" "$work/b/overlay.tar.gz" "$bin" >/dev/null); then
	ok "build 2 (other umask and temp dir)"
else
	fail "build 2"
fi
check "builds are byte-identical" cmp -s "$work/a/overlay.tar.gz" "$work/b/overlay.tar.gz"
SOURCE_DATE_EPOCH=1700000000 "$here/build-overlay.sh" "$work/c.tar.gz" "$bin" ${arg3:+"$arg3"} >/dev/null
check "SOURCE_DATE_EPOCH changes the bytes" sh -c "! cmp -s '$work/a/overlay.tar.gz' '$work/c.tar.gz'"
check "SOURCE_DATE_EPOCH dates every entry" test \
	"$(tar -tvzf "$work/c.tar.gz" | awk '{print $4}' | sort -u)" = "2023-11-14"
hdr=$(od -An -tx1 -N8 "$work/a/overlay.tar.gz" | tr -d ' \n')
check "gzip header has no name and no time ($hdr)" test "$hdr" = "1f8b080000000000"
owners=$(tar --numeric-owner -tvzf "$work/a/overlay.tar.gz" | awk '{print $2}' | sort -u)
check "every entry owned by 0/0 ($owners)" test "$owners" = "0/0"
dates=$(tar -tvzf "$work/a/overlay.tar.gz" | awk '{print $4 " " $5}' | sort -u)
check "every entry dated the epoch ($dates)" test "$dates" = "1970-01-01 00:00"
order=$(tar -tzf "$work/a/overlay.tar.gz")
check "entries sorted by name" test "$order" = "$(printf '%s\n' "$order" | LC_ALL=C sort)"

# Unpack (as root this keeps owners) and compare type, mode, owner, target.
mkdir "$work/root"
tar -xzpf "$work/a/overlay.tar.gz" -C "$work/root"
expected="d 700 0:0 var/lib/rancher/k3s/server
d 700 0:0 var/lib/rancher/k3s/server/manifests
d 755 0:0 etc/rancher
d 755 0:0 etc/rancher/k3s
d 755 0:0 etc/rancher/k3s/config.yaml.d
d 755 0:0 etc/spinifex-eks
d 755 0:0 var/lib/rancher
d 755 0:0 var/lib/rancher/k3s
f 644 0:0 etc/conf.d/konnectivity-agent
f 644 0:0 etc/conf.d/konnectivity-server
f 644 0:0 etc/rancher/k3s/config.yaml.d/konnectivity.yaml
f 644 0:0 etc/rancher/k3s/egress-selector-config.yaml
f 644 0:0 etc/spinifex-eks/first-boot.env.example
f 644 0:0 var/lib/rancher/k3s/server/manifests/konnectivity-agent.yaml
f 755 0:0 etc/init.d/konnectivity-agent
f 755 0:0 etc/init.d/konnectivity-server
f 755 0:0 usr/local/bin/konnectivity
l 777 0:0 usr/local/bin/eks-konnectivity-cert -> konnectivity
l 777 0:0 usr/local/bin/konnectivity-agent -> konnectivity
l 777 0:0 usr/local/bin/konnectivity-server -> konnectivity"
if [ -n "$image" ]; then
	expected=$(printf '%s\n%s\n%s\n' "$expected" \
		"d 755 0:0 var/lib/rancher/k3s/agent/images" \
		"f 644 0:0 var/lib/rancher/k3s/agent/images/konnectivity-agent.tar" | LC_ALL=C sort)
fi
entries=$(tar -tzf "$work/a/overlay.tar.gz" | sed 's|/$||')
got=$(
	cd "$work/root"
	for p in $entries; do
		if [ -L "$p" ]; then
			echo "l 777 $(stat -c %u:%g "$p") $p -> $(readlink "$p")"
		elif [ -d "$p" ]; then
			echo "d $(stat -c '%a %u:%g' "$p") $p"
		else
			echo "f $(stat -c '%a %u:%g' "$p") $p"
		fi
	done | LC_ALL=C sort
)
if [ "$got" = "$expected" ]; then
	ok "unpacked tree: every path, mode, owner and symlink as expected"
else
	fail "unpacked tree differs:"
	printf '%s\n' "$got" >"$work/got"
	printf '%s\n' "$expected" >"$work/want"
	diff "$work/want" "$work/got" || true
fi
# Nothing else was unpacked (directories implied by files are created by tar).
extra=$(cd "$work/root" && find . ! -type d | sed 's|^\./||' | LC_ALL=C sort)
check "no unexpected files" test "$extra" = "$(printf '%s\n' "$expected" | awk '$1 != "d" {print $4}' | LC_ALL=C sort)"

r=$work/root
check "binary is BIN" cmp -s "$bin" "$r/usr/local/bin/konnectivity"
for s in konnectivity-server konnectivity-agent; do
	check "etc/init.d/$s is openrc/$s.initd" cmp -s "$root/openrc/$s.initd" "$r/etc/init.d/$s"
	check "etc/conf.d/$s is openrc/$s.confd" cmp -s "$root/openrc/$s.confd" "$r/etc/conf.d/$s"
done
m=var/lib/rancher/k3s/server/manifests/konnectivity-agent.yaml
for f in $(cd "$here/eks-node" && find . -type f | sed 's|^\./||'); do
	[ "$f" = "$m" ] && continue
	check "$f is images/eks-node/$f" cmp -s "$here/eks-node/$f" "$r/$f"
done
check "$m is images/eks-node/$m with @VERSION@ = ${tag##*:}" sh -c \
	"sed 's/@VERSION@/${tag##*:}/' '$here/eks-node/$m' | cmp -s - '$r/$m'"

# The agent image: shipped where k3s imports it, and the one the manifest runs.
check "template manifest has one image line, $repo:@VERSION@" \
	test "$(grep -c "^        image: $repo:@VERSION@\$" "$here/eks-node/$m")" = 1
check "manifest runs $tag" grep -qx "        image: $tag" "$r/$m"
check "manifest: imagePullPolicy IfNotPresent" grep -qx "        imagePullPolicy: IfNotPresent" "$r/$m"
check "manifest: no hostPath, no pause image, no command override" sh -c \
	"! grep -Eq 'hostPath|pause|^ *command:' '$r/$m'"
check "manifest: runAsNonRoot" grep -qx "          runAsNonRoot: true" "$r/$m"
shipped=$r/var/lib/rancher/k3s/agent/images/konnectivity-agent.tar
if [ -n "$image" ]; then
	check "agent image in the overlay is the archive given" cmp -s "$image" "$shipped"
	name=$(tar -xOf "$shipped" index.json | grep -o '"io.containerd.image.name":"[^"]*"' | sed 's/.*:"\(.*\)"$/\1/')
	check "shipped image is named $name, which the manifest runs" grep -qx "        image: $name" "$r/$m"
	check "shipped image is an OCI layout" sh -c \
		"tar -xOf '$shipped' oci-layout | grep -qx '{\"imageLayoutVersion\":\"1.0.0\"}'"
	# An archive of another name is refused, not shipped under a wrong manifest.
	if (cd "$root" && go run ./images/ociimage -bin "$bin" -tag example.com/other:v1 -version v1 \
		-revision test -out "$work/other.tar" >/dev/null); then
		check "an image the manifest does not run is refused" sh -c \
			"! '$here/build-overlay.sh' '$work/d.tar.gz' '$bin' '$work/other.tar' 2>/dev/null"
	else
		fail "build an image of another name"
	fi
	check "a missing image file is refused" sh -c \
		"! '$here/build-overlay.sh' '$work/d.tar.gz' '$bin' '$work/nonexistent.tar' 2>/dev/null"
	check "an archive that is not an image is refused" sh -c \
		"! '$here/build-overlay.sh' '$work/d.tar.gz' '$bin' '$work/a/overlay.tar.gz' 2>/dev/null"
else
	echo "note: agent image checks skipped (no image)"
fi
check "no image and no AGENT_IMAGE_VERSION is refused" sh -c \
	"! env -u AGENT_IMAGE_VERSION -u AGENT_IMAGE '$here/build-overlay.sh' '$work/e.tar.gz' '$bin' 2>/dev/null"
check "a tag that is not a tag is refused" sh -c \
	"! env -u AGENT_IMAGE AGENT_IMAGE_VERSION='a/b' '$here/build-overlay.sh' '$work/e.tar.gz' '$bin' 2>/dev/null"
if env -u AGENT_IMAGE AGENT_IMAGE_VERSION=v9.9.9 "$here/build-overlay.sh" "$work/f.tar.gz" "$bin" >/dev/null; then
	mkdir "$work/f"
	tar -xzf "$work/f.tar.gz" -C "$work/f"
	check "AGENT_IMAGE_VERSION: manifest runs $repo:v9.9.9, no image shipped" sh -c \
		"grep -qx '        image: $repo:v9.9.9' '$work/f/$m' && test ! -e '$work/f/var/lib/rancher/k3s/agent'"
else
	fail "build with AGENT_IMAGE_VERSION"
fi

# The files agree with each other and with the init script's defaults.
initd=$r/etc/init.d/konnectivity-server
default() { sed -n "s/^: \"\${$1:=\(.*\)}\"\$/\1/p" "$initd"; }
uds=$(default KONNECTIVITY_UDS)
check "egress selector uses the server's socket ($uds)" \
	grep -qx "        udsName: $uds" "$r/etc/rancher/k3s/egress-selector-config.yaml"
check "egress selector: cluster is HTTPConnect (server --mode=http-connect)" \
	grep -qx "    proxyProtocol: HTTPConnect" "$r/etc/rancher/k3s/egress-selector-config.yaml"
check "egress selector: controlplane and etcd are Direct" \
	test "$(grep -c '^    proxyProtocol: Direct$' "$r/etc/rancher/k3s/egress-selector-config.yaml")" = 2
esc=$(sed -n 's/^  - egress-selector-config-file=//p' "$r/etc/rancher/k3s/config.yaml.d/konnectivity.yaml")
check "k3s snippet points at the shipped egress selector file ($esc)" test -f "$r$esc"
check "k3s snippet disables k3s's own egress selector" \
	grep -qx "egress-selector-mode: disabled" "$r/etc/rancher/k3s/config.yaml.d/konnectivity.yaml"
m=$r/$m
check "manifest audience matches the server's ($(default KONNECTIVITY_AUDIENCE))" \
	grep -qx "              audience: $(default KONNECTIVITY_AUDIENCE)" "$m"
check "manifest ServiceAccount matches the server's" sh -c \
	"grep -qx '  name: $(default KONNECTIVITY_AGENT_SERVICE_ACCOUNT)' '$m' && grep -qx '  namespace: $(default KONNECTIVITY_AGENT_NAMESPACE)' '$m'"
for k in proxy-server-host proxy-server-port; do
	check "manifest reads ConfigMap key $k, which the server writes" sh -c \
		"grep -qx '              key: $k' '$m' && grep -q '^  $k: ' '$initd'"
done
check "the server writes that ConfigMap next to the manifest" \
	test "$(default KONNECTIVITY_AGENT_CONFIG_MANIFEST)" = /var/lib/rancher/k3s/server/manifests/konnectivity-agent-config.yaml
env_sans=$(sh -c ". '$r/etc/spinifex-eks/first-boot.env.example'; echo \"\$EKS_KONNECTIVITY_SERVER_COUNT \$EKS_KONNECTIVITY_SANS\"")
check "first-boot.env.example sets count and SANs ($env_sans)" test "${env_sans#* }" != "" -a "${env_sans%% *}" -gt 0

# A real import, when containerd is installed (and we are root): containerd
# names the image exactly as the manifest references it, and runs its
# entrypoint as the image's user. A private containerd (own socket, root and
# state under $work, no CRI plugin) so nothing of the machine's is touched;
# the agent runs in its own network namespace, so it binds no host port.
if [ -z "$image" ]; then
	:
elif ! command -v containerd >/dev/null 2>&1 || ! command -v ctr >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
	echo "note: containerd/ctr not installed (or not root): containerd import checks skipped"
else
	c=$work/containerd
	mkdir -p "$c"
	printf '%s\n' 'version = 2' "root = \"$c/root\"" "state = \"$c/state\"" \
		'disabled_plugins = ["io.containerd.grpc.v1.cri"]' '[grpc]' "address = \"$c/sock\"" >"$c/config.toml"
	containerd --config "$c/config.toml" >"$c/log" 2>&1 &
	cpid=$!
	ctr_() { timeout 60 ctr -a "$c/sock" -n k8s.io "$@"; }
	i=0
	until [ -S "$c/sock" ] || [ $i -ge 100 ]; do
		sleep 0.1
		i=$((i + 1))
	done
	if ctr_ images import --snapshotter native "$shipped" >"$c/import" 2>&1; then
		ok "containerd imports the shipped archive"
	else
		fail "containerd imports the shipped archive: $(cat "$c/import" "$c/log")"
	fi
	check "containerd names it $name, as the manifest runs" test "$(ctr_ images ls -q)" = "$name"
	out=$(ctr_ run --snapshotter native --rm "$name" konnectivity-version /usr/local/bin/konnectivity version 2>&1) || true
	case $out in
	"konnectivity "*) ok "konnectivity version inside the container ($out)" ;;
	*) fail "konnectivity version inside the container: $out" ;;
	esac
	if ctr_ run --snapshotter native -d "$name" konnectivity-agent >/dev/null 2>&1; then
		pid=$(ctr_ tasks ls | awk '$1 == "konnectivity-agent" {print $2}')
		check "entrypoint is konnectivity agent" test "$(tr '\0' ' ' <"/proc/$pid/cmdline")" = "/usr/local/bin/konnectivity agent "
		check "it runs as 65532:65532" test "$(awk '/^(Uid|Gid):/ {printf "%s ", $2}' "/proc/$pid/status")" = "65532 65532 "
		ctr_ tasks kill -s SIGKILL konnectivity-agent >/dev/null 2>&1 || true
		i=0
		until ctr_ tasks rm konnectivity-agent >/dev/null 2>&1 || [ $i -ge 100 ]; do
			sleep 0.1
			i=$((i + 1))
		done
		ctr_ containers rm konnectivity-agent >/dev/null 2>&1 || true
	else
		fail "run the image's entrypoint in containerd"
	fi
	kill "$cpid"
	wait "$cpid" || true
	cpid=
fi

if command -v shellcheck >/dev/null 2>&1; then
	check "shellcheck build-overlay.sh test.sh" shellcheck "$here/build-overlay.sh" "$0"
else
	fail "shellcheck not installed"
fi
echo "$PASSES passed, $FAILS failed"
[ "$FAILS" = 0 ]
