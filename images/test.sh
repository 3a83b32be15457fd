#!/bin/sh
# shellcheck shell=sh disable=SC2015
# Test of images/build-overlay.sh: two builds are byte-identical, and the
# unpacked tarball has exactly the expected paths, modes, owners and symlinks.
# Uses $KONNECTIVITY_BIN, else bin/konnectivity, else a stand-in executable.
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
trap 'rm -rf "$work"' EXIT
bin=${KONNECTIVITY_BIN:-$root/bin/konnectivity}
if [ ! -x "$bin" ]; then
	bin=$work/konnectivity
	printf '#!/bin/sh\necho stand-in konnectivity\n' >"$bin"
	chmod 755 "$bin"
	echo "note: $root/bin/konnectivity missing, using a stand-in binary"
fi

# Two builds from different temp dirs and umasks must give the same bytes.
if (cd / && umask 022 && TMPDIR=$work "$here/build-overlay.sh" "$work/a/overlay.tar.gz" "$bin" >/dev/null); then
	ok "build 1"
else
	fail "build 1"
fi
mkdir -p "$work/tmp2"
if (cd "$work" && umask 077 && TMPDIR=$work/tmp2 "$here/build-overlay.sh" "$work/b/overlay.tar.gz" "$bin" >/dev/null); then
	ok "build 2 (other umask and temp dir)"
else
	fail "build 2"
fi
check "builds are byte-identical" cmp -s "$work/a/overlay.tar.gz" "$work/b/overlay.tar.gz"
SOURCE_DATE_EPOCH=1700000000 "$here/build-overlay.sh" "$work/c.tar.gz" "$bin" >/dev/null
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
for f in $(cd "$here/eks-node" && find . -type f | sed 's|^\./||'); do
	check "$f is images/eks-node/$f" cmp -s "$here/eks-node/$f" "$r/$f"
done

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
m=$r/var/lib/rancher/k3s/server/manifests/konnectivity-agent.yaml
check "manifest audience matches the server's ($(default KONNECTIVITY_AUDIENCE))" \
	grep -qx "              audience: $(default KONNECTIVITY_AUDIENCE)" "$m"
check "manifest ServiceAccount matches the server's" sh -c \
	"grep -qx '  name: $(default KONNECTIVITY_AGENT_SERVICE_ACCOUNT)' '$m' && grep -qx '  namespace: $(default KONNECTIVITY_AGENT_NAMESPACE)' '$m'"
check "manifest runs the binary the overlay installs" grep -qx "          path: /usr/local/bin/konnectivity" "$m"
for k in proxy-server-host proxy-server-port; do
	check "manifest reads ConfigMap key $k, which the server writes" sh -c \
		"grep -qx '              key: $k' '$m' && grep -q '^  $k: ' '$initd'"
done
check "the server writes that ConfigMap next to the manifest" \
	test "$(default KONNECTIVITY_AGENT_CONFIG_MANIFEST)" = /var/lib/rancher/k3s/server/manifests/konnectivity-agent-config.yaml
env_sans=$(sh -c ". '$r/etc/spinifex-eks/first-boot.env.example'; echo \"\$EKS_KONNECTIVITY_SERVER_COUNT \$EKS_KONNECTIVITY_SANS\"")
check "first-boot.env.example sets count and SANs ($env_sans)" test "${env_sans#* }" != "" -a "${env_sans%% *}" -gt 0

if command -v shellcheck >/dev/null 2>&1; then
	check "shellcheck build-overlay.sh test.sh" shellcheck "$here/build-overlay.sh" "$0"
else
	fail "shellcheck not installed"
fi
echo "$PASSES passed, $FAILS failed"
[ "$FAILS" = 0 ]
