#!/bin/sh
# shellcheck shell=sh disable=SC2317,SC2086,SC2015
# Real OpenRC test of openrc/konnectivity-{server,agent}.initd: the scripts run
# under openrc-run and supervise-daemon with the real binary, a fake k3s tree
# (CA, CA key, admin kubeconfig) and a fake TokenReview apiserver.
#
# It re-runs itself in private mount + pid + net namespaces: a tmpfs /run, an
# overlay over /etc, tmpfs /var/lib, /var/log and /usr/local/bin. When it
# exits the kernel kills every daemon it started and nothing on the host is
# touched. Runs once per shell mode: busybox ash (Alpine's /bin/sh) and dash.
#
#   sudo openrc/test.sh                       # both shell modes
#   OPENRC_TEST_SHELL=dash openrc/test.sh     # one mode
#   KONNECTIVITY_BIN=/path/konnectivity openrc/test.sh
#
# Needs root, openrc, busybox-static, shellcheck, openssl, curl, go. A test
# that cannot run fails when CI=true and is skipped otherwise.
# The last line is "N passed, N failed"; the exit status is non-zero on any
# failure.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)

if [ "${OPENRC_TEST_INNER:-}" != 1 ]; then
	cannot() {
		echo "cannot run: $*"
		if [ "${CI:-}" = true ]; then
			echo "0 passed, 1 failed"
			exit 1
		fi
		echo "SKIP (set CI=true to make this a failure)"
		echo "0 passed, 0 failed"
		exit 0
	}
	[ "$(id -u)" = 0 ] || cannot "needs root"
	for t in /sbin/openrc-run /sbin/supervise-daemon /usr/bin/busybox; do
		[ -x "$t" ] || cannot "$t missing (apt-get install -y --no-install-recommends openrc busybox-static shellcheck)"
	done
	for t in shellcheck openssl curl go unshare dash; do
		command -v "$t" >/dev/null 2>&1 || cannot "$t not on PATH"
	done
	bin=${KONNECTIVITY_BIN:-$root/bin/konnectivity}
	[ -x "$bin" ] || cannot "$bin missing (run make build)"
	work=$(mktemp -d)
	trap 'rm -rf "$work"' EXIT
	if ! (cd "$root" && CGO_ENABLED=0 go build -o "$work/testhelper" ./openrc/testdata/testhelper); then
		echo "build of openrc/testdata/testhelper failed"
		echo "0 passed, 1 failed"
		exit 1
	fi
	passed=0 failed=0
	for mode in ${OPENRC_TEST_SHELL:-ash dash}; do
		echo "=== shell mode: $mode"
		mkdir -p "$work/$mode"
		set +e
		OPENRC_TEST_INNER=1 OPENRC_TEST_WORK="$work/$mode" OPENRC_TEST_SHELL=$mode \
			OPENRC_TEST_BIN=$bin OPENRC_TEST_HELPER=$work/testhelper \
			unshare --mount --pid --net --fork --kill-child --mount-proc --propagation private \
			"$work/testhelper" init -- "$here/test.sh" >"$work/$mode.out" 2>&1
		rc=$?
		set -e
		cat "$work/$mode.out"
		last=$(tail -n 1 "$work/$mode.out")
		case "$last" in
		*" passed, "*" failed")
			p=${last%% passed*}
			f=${last#*passed, }
			f=${f%% failed}
			;;
		*) p=0 f=1 ;;
		esac
		[ "$rc" = 0 ] || [ "$f" != 0 ] || f=1
		passed=$((passed + p))
		failed=$((failed + f))
	done
	echo "$passed passed, $failed failed"
	[ "$failed" = 0 ]
	exit
fi

# ---------------------------------------------------------------- inner part
ms() { date +%s%N | cut -c1-13; }
T0=$(ms)
step() { echo "[$(($(ms) - T0)) ms] -- $*"; }
PASSES=0 FAILS=0
ok() {
	echo "ok: $*"
	PASSES=$((PASSES + 1))
}
fail() {
	echo "FAIL: $*"
	FAILS=$((FAILS + 1))
}
check() { # check DESCRIPTION COMMAND...
	_d=$1
	shift
	if "$@"; then ok "$_d"; else fail "$_d"; fi
}
# wait_for COMMAND...: retry for up to 30 s (a bound, not an assertion).
wait_for() {
	_i=0
	until "$@"; do
		_i=$((_i + 1))
		[ "$_i" -lt 300 ] || return 1
		sleep 0.1
	done
}
finish() {
	if [ "$FAILS" != 0 ]; then
		for _l in /var/log/konnectivity-server.log /var/log/konnectivity-agent.log /run/test/helper-api.log; do
			[ -f "$_l" ] && { echo "--- tail $_l"; tail -n 25 "$_l"; }
		done
	fi
	echo "$PASSES passed, $FAILS failed"
	[ "$FAILS" = 0 ]
	exit
}

work=$OPENRC_TEST_WORK
bin=$OPENRC_TEST_BIN
srv=konnectivity-server
agt=konnectivity-agent
uds=/run/konnectivity/konnectivity-server.socket
tls=/var/lib/rancher/k3s/server/tls
kubeconfig=/etc/rancher/k3s/k3s.yaml

# --- sandbox ----------------------------------------------------------------
ip link set lo up 2>/dev/null || busybox ip link set lo up
mount -n -t tmpfs tmpfs /run
mkdir -p /run/openrc /run/test /run/www
touch /run/openrc/softlevel
mkdir -p "$work/ovl"
mount -n -t tmpfs tmpfs "$work/ovl"
mkdir -p "$work/ovl/upper" "$work/ovl/work" "$work/ovl/initd"
mount -n -t overlay overlay -o "lowerdir=/etc,upperdir=$work/ovl/upper,workdir=$work/ovl/work" /etc
mount -n --bind "$work/ovl/initd" /etc/init.d # only our services: clean deptree
mkdir -p /etc/conf.d /etc/rancher/k3s /etc/spinifex-eks
for d in /var/lib /var/log /usr/local/bin; do mount -n -t tmpfs tmpfs "$d"; done
if [ "$OPENRC_TEST_SHELL" = ash ]; then
	# openrc-run prefers $RC_SVCDIR/openrc-run.sh: run the service scripts
	# under busybox ash, Alpine's /bin/sh, instead of Debian's dash.
	{
		echo '#!/usr/bin/busybox ash'
		tail -n +2 /lib/rc/sh/openrc-run.sh
	} >/run/openrc/openrc-run.sh
	chmod 755 /run/openrc/openrc-run.sh
fi

install -m 0755 "$bin" /usr/local/bin/konnectivity
for n in konnectivity-server konnectivity-agent eks-konnectivity-cert; do
	ln -s konnectivity "/usr/local/bin/$n"
done
install -m 0755 "$here/konnectivity-server.initd" /etc/init.d/$srv
install -m 0755 "$here/konnectivity-agent.initd" /etc/init.d/$agt
cat >/etc/init.d/fakenet <<'EOS'
#!/sbin/openrc-run
description="stub net provider (Debian's openrc has none)"
depend() { provide net; }
start() { return 0; }
stop() { return 0; }
EOS
chmod 755 /etc/init.d/fakenet

# The shipped conf.d files, plus test settings appended (later lines win).
{
	cat "$here/konnectivity-server.confd"
	echo 'respawn_delay=1'
	echo 'retry="TERM/10/KILL/5"'
	echo 'KONNECTIVITY_WAIT_SECONDS=2'
	echo 'KONNECTIVITY_SERVER_OPTS="--v=4 --graceful-shutdown-timeout=2s --route-agents=node1"'
	# Below the sandbox's hard limit, which it may lower but not raise.
	echo 'KONNECTIVITY_NOFILE=16384'
} >/etc/conf.d/$srv
cp /etc/conf.d/$srv "$work/server.confd"
{
	cat "$here/konnectivity-agent.confd"
	echo 'KONNECTIVITY_SERVER_HOST=127.0.0.1'
	echo 'KONNECTIVITY_TOKEN_PATH=/run/test/token'
	echo 'KONNECTIVITY_AGENT_ID=node1'
	echo "KONNECTIVITY_AGENT_IDENTIFIERS='host=node1&ipv4=127.0.0.1&default-route=true'"
	echo 'KONNECTIVITY_AGENT_OPTS="--sync-interval-cap=2s --drain-timeout=2s"'
	echo 'KONNECTIVITY_NOFILE=16000'
	echo 'respawn_delay=1'
	echo 'retry="TERM/10/KILL/5"'
} >/etc/conf.d/$agt
cat >/etc/spinifex-eks/first-boot.env <<'EOS'
# written by the test
EKS_KONNECTIVITY_SERVER_COUNT=1
EKS_KONNECTIVITY_SANS="127.0.0.1,localhost,konnectivity.example.internal"
EOS
cp /etc/spinifex-eks/first-boot.env "$work/first-boot.env"

# --- fake k3s: CA (EC P-256, SEC1 key, like k3s), admin kubeconfig ---------
mkdir -p $tls /var/lib/rancher/k3s/agent /var/lib/rancher/k3s/server/manifests
openssl ecparam -name prime256v1 -genkey -noout -out $tls/server-ca.key 2>/dev/null
openssl req -x509 -new -key $tls/server-ca.key -subj "/CN=k3s-server-ca@1700000000" \
	-days 3650 -addext "basicConstraints=critical,CA:TRUE" \
	-addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
	-out $tls/server-ca.crt 2>/dev/null
chmod 600 $tls/server-ca.key
cp $tls/server-ca.crt /var/lib/rancher/k3s/agent/server-ca.crt
konn() { /usr/local/bin/konnectivity "$@"; }
konn cert -dir /run/test/api -ca-cert $tls/server-ca.crt -ca-key $tls/server-ca.key \
	-cn kube-apiserver -sans 127.0.0.1,localhost >/dev/null
konn cert -client -dir /run/test/admin -ca-cert $tls/server-ca.crt -ca-key $tls/server-ca.key \
	-cn system:admin >/dev/null
b64() { base64 -w0 <"$1"; }
cat >$kubeconfig <<EOS
apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority-data: $(b64 $tls/server-ca.crt)
    server: https://127.0.0.1:6443
  name: default
contexts:
- context:
    cluster: default
    user: default
  name: default
current-context: default
users:
- name: default
  user:
    client-certificate-data: $(b64 /run/test/admin/tls.crt)
    client-key-data: $(b64 /run/test/admin/tls.key)
EOS
chmod 600 $kubeconfig
head -c 24 /dev/urandom | base64 | tr -d '/+=' >/run/test/token
"$OPENRC_TEST_HELPER" serve -addr 127.0.0.1:6443 -cert /run/test/api/tls.crt -key /run/test/api/tls.key \
	-client-ca $tls/server-ca.crt -token-file /run/test/token >/run/test/helper-api.log 2>&1 &
echo backend-ok >/run/www/index.html
busybox httpd -f -p 127.0.0.1:18080 -h /run/www &
api_up() {
	curl -s -o /dev/null -m 2 --cacert $tls/server-ca.crt --cert /run/test/admin/tls.crt \
		--key /run/test/admin/tls.key https://127.0.0.1:6443/ 2>/dev/null
}
wait_for api_up || fail "fake apiserver did not come up"
rc-update -u >/dev/null 2>&1
step "sandbox ready (shell mode $OPENRC_TEST_SHELL)"

# --- static checks ----------------------------------------------------------
for s in $srv $agt; do
	out=$(busybox ash -n /etc/init.d/$s 2>&1) && ok "$s: busybox ash -n" || fail "$s: ash -n: $out"
	out=$(dash -n /etc/init.d/$s 2>&1) && ok "$s: dash -n" || fail "$s: dash -n: $out"
	out=$(shellcheck /etc/init.d/$s 2>&1) && ok "$s: shellcheck" || fail "$s: shellcheck: $out"
	out=$(shellcheck -s sh -e SC2034 "$here/$s.confd" 2>&1) && ok "$s.confd: shellcheck" ||
		fail "$s.confd: shellcheck: $out"
done
out=$(shellcheck "$0" 2>&1) && ok "test.sh: shellcheck" || fail "test.sh: shellcheck: $out"
check "deptree: $srv needs net" grep -q "_ineed_0='net'" /run/openrc/deptree
check "deptree: $srv after k3s" grep -q "_iafter_0='k3s'" /run/openrc/deptree
if [ "$OPENRC_TEST_SHELL" = ash ]; then
	check "service scripts run under busybox ash" grep -q '^#!/usr/bin/busybox ash' /run/openrc/openrc-run.sh
fi
step "static checks"

# --- helpers on the running service -----------------------------------------
opt() { cat "/run/openrc/options/$1/$2" 2>/dev/null; }
child() { opt $srv child_pid; }
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
healthz() { curl -fsS -m 2 -o /dev/null "http://127.0.0.1:$1/healthz" 2>/dev/null; }
readyz() { curl -fsS -m 2 -o /dev/null "http://127.0.0.1:8134/readyz" 2>/dev/null; }
uds_up() { [ -S $uds ]; }
nofile() { awk '/^Max open files/ { print $4 "/" $5 }' "/proc/$1/limits"; }
server_up() { uds_up && healthz 8134; }
dial() { "$OPENRC_TEST_HELPER" connect -uds $uds -target 127.0.0.1:18080 2>/run/test/dial.err | grep -qx backend-ok; }
respawned() { # respawned OLD_PID OLD_START_COUNT
	_c=$(child)
	alive "$_c" && [ "$_c" != "$1" ] && [ "$(opt $srv start_count)" -gt "$2" ]
}
konn_procs() {
	for _p in /proc/[0-9]*; do
		[ "$(cat "$_p/comm" 2>/dev/null)" = konnectivity ] && echo "${_p#/proc/}"
	done
	return 0
}
status_rc() {
	set +e
	rc-service "$1" status >/dev/null 2>&1
	_st=$?
	set -e
	echo "$_st"
}
start_fails_with() { # start_fails_with SERVICE MESSAGE DESCRIPTION
	set +e
	_out=$(rc-service "$1" start 2>&1)
	_st=$?
	set -e
	if [ "$_st" != 0 ] && printf '%s\n' "$_out" | grep -qF -- "$2" && [ ! -e "/run/$1.pid" ] &&
		[ "$(status_rc "$1")" = 3 ]; then
		ok "$3 (rc $_st)"
	else
		fail "$3: rc $_st, output: $_out"
	fi
	rc-service "$1" zap >/dev/null 2>&1 || true
}

# --- start ------------------------------------------------------------------
out=$(rc-service $srv start 2>&1) && ok "$srv start" || fail "$srv start: $out"
check "fakenet started first (need net)" test "$(status_rc fakenet)" = 0
check "UDS $uds appears" wait_for uds_up
check "/healthz answers on 8134" wait_for healthz 8134
check "admin port 8133 answers" wait_for healthz 8133
check "status started (0)" test "$(status_rc $srv)" = 0
check "socket is 0600" test "$(stat -c %a $uds)" = 600
check "server's descriptor limit is KONNECTIVITY_NOFILE ($(nofile "$(child)"))" test "$(nofile "$(child)")" = 16384/16384
check "/run/konnectivity is 0750" test "$(stat -c %a /run/konnectivity)" = 750
check "serving cert minted" test -s /var/lib/konnectivity/tls/tls.crt
check "serving key is 0600" test "$(stat -c %a /var/lib/konnectivity/tls/tls.key)" = 600
sans=$(openssl x509 -in /var/lib/konnectivity/tls/tls.crt -noout -ext subjectAltName 2>/dev/null | tail -n +2 | tr -d ' \n')
check "cert SANs from first-boot.env ($sans)" test "$sans" = "DNS:localhost,DNS:konnectivity.example.internal,IPAddress:127.0.0.1"
check "cert signed by the k3s CA" openssl verify -CAfile $tls/server-ca.crt /var/lib/konnectivity/tls/tls.crt
cert_sum=$(sha256sum /var/lib/konnectivity/tls/tls.crt | cut -d' ' -f1)
args=$(tr '\0' ' ' <"/proc/$(child)/cmdline")
for a in "server" "--mode=http-connect" "--uds-name=$uds" "--server-port=0" "--agent-port=8132" \
	"--cluster-cert=/var/lib/konnectivity/tls/tls.crt" "--cluster-key=/var/lib/konnectivity/tls/tls.key" \
	"--kubeconfig=$kubeconfig" "--authentication-audience=system:konnectivity-server" \
	"--agent-namespace=kube-system" "--agent-service-account=konnectivity-agent" \
	"--proxy-strategies=destHost,default" "--server-count=1" "--health-port=8134" \
	"--admin-port=8133" "--v=4"; do
	case " $args " in
	*" $a "*) ok "server arg $a" ;;
	*) fail "server arg $a missing from: $args" ;;
	esac
done
check "output_log written" grep -q listening /var/log/$srv.log
agentcm=/var/lib/rancher/k3s/server/manifests/konnectivity-agent-config.yaml
check "agent ConfigMap manifest names the first SAN" grep -qx '  proxy-server-host: "127.0.0.1"' $agentcm
check "agent ConfigMap manifest has the agent port" grep -qx '  proxy-server-port: "8132"' $agentcm
check "agent ConfigMap carries the agent side's label (kubectl delete -l k8s-app=konnectivity-agent)" \
	grep -qx '    k8s-app: konnectivity-agent' $agentcm
cm_mtime=$(stat -c %i $agentcm)
set +e
readyz
st=$?
set -e
check "/readyz fails with no agent" test "$st" != 0
out=$(rc-service $srv healthcheck 2>&1) && ok "healthcheck (default probe) passes" || fail "healthcheck: $out"
step "server started"

# --- agent service, TokenReview, a dial through the UDS ----------------------
out=$(rc-service $agt start 2>&1) && ok "$agt start" || fail "$agt start: $out"
check "agent /healthz answers on 8093" wait_for healthz 8093
check "agent's descriptor limit is KONNECTIVITY_NOFILE ($(nofile "$(opt $agt child_pid)"))" test "$(nofile "$(opt $agt child_pid)")" = 16000/16000
check "server /readyz passes once the agent is in" wait_for readyz
check "TokenReview accepted the agent's token" grep -q "authenticated=true" /run/test/helper-api.log
agent_args=$(tr '\0' ' ' <"/proc/$(opt $agt child_pid)/cmdline")
case "$agent_args" in
*"--agent-identifiers=host=node1&ipv4=127.0.0.1&default-route=true "*) ok "agent identifiers passed intact" ;;
*) fail "agent identifiers: $agent_args" ;;
esac
check "agent healthcheck passes" rc-service $agt healthcheck
if wait_for dial; then ok "CONNECT through the UDS reaches the backend"; else fail "dial: $(cat /run/test/dial.err)"; fi
step "agent connected, dial works"

# --- kill -9 the daemon: supervise-daemon respawns it ------------------------
old=$(child)
sc=$(opt $srv start_count)
sup=$(cat /run/$srv.pid)
kill -9 "$old"
check "respawned after kill -9 (pid $old, start_count $sc)" wait_for respawned "$old" "$sc"
echo "   new pid $(child), start_count $(opt $srv start_count)"
check "supervisor unchanged" test "$(cat /run/$srv.pid)" = "$sup"
check "UDS and /healthz back after respawn" wait_for server_up
check "dial works after respawn (agent reconnected)" wait_for dial
check "status started after respawn" test "$(status_rc $srv)" = 0
step "respawn verified"

# --- reload: SIGHUP via supervise-daemon --signal ----------------------------
# The binary re-executes itself in place on SIGHUP: same PID, so
# supervise-daemon sees no exit and start_count stays.
reexecs() { grep -c "re-executing in place" "/var/log/$1.log" || true; }
reexeced() { [ "$(reexecs "$1")" -gt "$2" ]; }
old=$(child)
sc=$(opt $srv start_count)
n=$(reexecs $srv)
out=$(rc-service $srv reload 2>&1) && ok "$srv reload returns 0" || fail "$srv reload: $out"
check "reload: the server re-executed itself" wait_for reexeced $srv "$n"
check "UDS and /healthz back after reload" wait_for server_up
check "reload kept the PID ($old)" test "$(child)" = "$old"
check "reload: no respawn (start_count $sc)" test "$(opt $srv start_count)" = "$sc"
check "dial works after reload" wait_for dial
check "status started after reload" test "$(status_rc $srv)" = 0
aold=$(opt $agt child_pid)
n=$(reexecs $agt)
out=$(rc-service $agt reload 2>&1) && ok "$agt reload returns 0" || fail "$agt reload: $out"
check "reload: the agent re-executed itself" wait_for reexeced $agt "$n"
check "agent reload kept the PID ($aold)" test "$(opt $agt child_pid)" = "$aold"
check "agent /healthz back after reload" wait_for healthz 8093
check "dial works after agent reload" wait_for dial
step "reload verified"

# --- healthcheck failure: supervise-daemon restarts the daemon ---------------
# conf.d is read again by every healthcheck run, so the probe can be broken
# while the service runs.
{
	cat "$work/server.confd"
	echo 'healthcheck_delay=1'
	echo 'healthcheck_timer=1'
	echo 'retry="TERM/3/KILL/2"'
	echo 'KONNECTIVITY_HEALTHCHECK_CMD="test ! -e /run/test/unhealthy"'
} >/etc/conf.d/$srv
out=$(rc-service $srv restart 2>&1) && ok "restart returns 0" || fail "restart: $out"
check "up after restart" wait_for server_up
check "restart reused the serving cert" test "$(sha256sum /var/lib/konnectivity/tls/tls.crt | cut -d' ' -f1)" = "$cert_sum"
check "restart left the unchanged ConfigMap manifest alone" test "$(stat -c %i $agentcm)" = "$cm_mtime"
step "restarted"
old=$(child)
sc=$(opt $srv start_count)
touch /run/test/unhealthy
check "failing healthcheck makes supervise-daemon restart the server" wait_for respawned "$old" "$sc"
rm -f /run/test/unhealthy
check "up after the healthcheck restart" wait_for server_up
cp "$work/server.confd" /etc/conf.d/$srv
step "healthcheck verified"

# --- stop -------------------------------------------------------------------
asup=$(cat /run/$agt.pid)
achild=$(opt $agt child_pid)
out=$(rc-service $agt stop 2>&1) && ok "$agt stop" || fail "$agt stop: $out"
check "agent supervisor and daemon gone" sh -c "! kill -0 $asup 2>/dev/null && ! kill -0 $achild 2>/dev/null"
sup=$(cat /run/$srv.pid)
cur=$(child)
out=$(rc-service $srv stop 2>&1) && ok "$srv stop" || fail "$srv stop: $out"
check "server supervisor and daemon gone" sh -c "! kill -0 $sup 2>/dev/null && ! kill -0 $cur 2>/dev/null"
check "no konnectivity process left" test -z "$(konn_procs)"
check "socket removed" test ! -e $uds
check "pidfile removed" test ! -e /run/$srv.pid
check "status stopped (3)" test "$(status_rc $srv)" = 3
set +e
rc-service $srv healthcheck >/dev/null 2>&1
st=$?
set -e
check "healthcheck fails when stopped" test "$st" != 0
step "stopped"

# --- start_pre failures -----------------------------------------------------
sed -i 's/^EKS_KONNECTIVITY_SANS=.*/EKS_KONNECTIVITY_SANS=""/' /etc/spinifex-eks/first-boot.env
start_fails_with $srv "no SANs for the serving certificate: EKS_KONNECTIVITY_SANS is empty" "empty SANs refused"
rm /etc/spinifex-eks/first-boot.env
start_fails_with $srv "EKS_KONNECTIVITY_SANS is empty or unset in /etc/spinifex-eks/first-boot.env" "missing first-boot.env refused"
cp "$work/first-boot.env" /etc/spinifex-eks/first-boot.env
sed -i 's/^EKS_KONNECTIVITY_SERVER_COUNT=.*/EKS_KONNECTIVITY_SERVER_COUNT=two/' /etc/spinifex-eks/first-boot.env
start_fails_with $srv "server count 'two'" "bad server count refused"
cp "$work/first-boot.env" /etc/spinifex-eks/first-boot.env

mv $tls/server-ca.crt /run/test/ca.crt
start_fails_with $srv "k3s server CA certificate $tls/server-ca.crt missing or empty after waiting 2s" "missing CA refused after the bounded wait"
mv $tls/server-ca.key /run/test/ca.key
start_fails_with $srv "k3s server CA key $tls/server-ca.key missing or empty after waiting 2s" "missing CA key refused"
mv /run/test/ca.crt $tls/server-ca.crt
mv /run/test/ca.key $tls/server-ca.key
mv $kubeconfig /run/test/k3s.yaml
start_fails_with $srv "kubeconfig for TokenReview $kubeconfig missing or empty after waiting 2s" "missing kubeconfig refused"

# The wait is real: a kubeconfig that k3s writes late is picked up.
echo 'KONNECTIVITY_WAIT_SECONDS=30' >>/etc/conf.d/$srv
(
	sleep 2
	mv /run/test/k3s.yaml $kubeconfig
) &
out=$(rc-service $srv start 2>&1) && ok "start waits for a late kubeconfig" || fail "late kubeconfig: $out"
check "up after the wait" wait_for server_up
out=$(rc-service $srv stop 2>&1) || fail "stop: $out"
cp "$work/server.confd" /etc/conf.d/$srv

mv /usr/local/bin/konnectivity /run/test/konnectivity
start_fails_with $srv "binary /usr/local/bin/konnectivity is missing" "missing binary refused"
mv /run/test/konnectivity /usr/local/bin/konnectivity
cp /etc/conf.d/$agt /run/test/agent.confd
echo 'KONNECTIVITY_SERVER_HOST=""' >>/etc/conf.d/$agt
start_fails_with $agt "KONNECTIVITY_SERVER_HOST is not set" "agent without server host refused"
cp /run/test/agent.confd /etc/conf.d/$agt
echo 'KONNECTIVITY_TOKEN_PATH=""' >>/etc/conf.d/$agt
start_fails_with $agt "no credentials" "agent without credentials refused"
cp /run/test/agent.confd /etc/conf.d/$agt
step "start_pre failures verified"

rm /etc/init.d/fakenet
rc-update -u >/dev/null 2>&1 || true
rc-service $srv zap >/dev/null 2>&1 || true
set +e
out=$(rc-service $srv start 2>&1)
st=$?
set -e
if [ "$st" != 0 ] && printf '%s\n' "$out" | grep -q "needs service(s) net"; then
	ok "start without a net provider refused"
else
	fail "need net: rc $st: $out"
fi
check "nothing running at the end" test -z "$(konn_procs)"
step "done"
finish
