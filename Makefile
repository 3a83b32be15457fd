# konnectivity: one static binary for server, agent, cert minting and demo.
#
#   make            build bin/konnectivity (static, stripped)
#   make demo       run the embedded default: throwaway CA, server, agent, backend on loopback
#   make test       every test: lint, unit (with -race), fuzz seeds, e2e
#   make test-loaded  make test beside one more CPU hog than the machine has cores
#   make e2e-loaded   the e2e suite likewise
#   make bench      the benchmark table
#   make bench-scale  one server, 5,000 agents, 50,000 tunnels (not part of make test)
#   make bench-fairness  a probe tunnel beside bulk ones on shaped and long links (root; not part of make test)
#   make bench-stress  2,000 tunnels x 5 MiB at once beside CPU hogs (not part of make test)
#   make install    install into $(DESTDIR)$(PREFIX)/bin with the upstream names as symlinks

GO        ?= go
PREFIX    ?= /usr/local
DESTDIR   ?=
# What `konnectivity version` prints. VERSION: the newest release tag
# (v1.2.3, or v1.2.3-N-gHASH past it), else the newest version CHANGELOG.md
# names with -dev.HASH; BUILD_DATE: the commit's time, so the same source
# builds the same bytes.
VERSION    ?= $(shell git describe --tags --match 'v[0-9]*' --dirty 2>/dev/null || echo "$$(sed -n 's/^\#\# \(v[0-9][0-9.]*\).*/\1/p' CHANGELOG.md | head -1)-dev.$$(git describe --always --dirty 2>/dev/null || echo unknown)")
REVISION   ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
BUILD_DATE ?= $(shell TZ=UTC git log -1 --date=format-local:%Y-%m-%dT%H:%M:%SZ --format=%cd 2>/dev/null)
BIN        := bin/konnectivity
LDFLAGS    := -s -w -X main.version=$(VERSION) -X main.commit=$(REVISION) -X main.buildDate=$(BUILD_DATE)
GOBUILD   := CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)"
ALIASES   := konnectivity-server konnectivity-agent eks-konnectivity-cert
STATICCHECK ?= $(shell command -v staticcheck 2>/dev/null || echo $(HOME)/go/bin/staticcheck)
DEADCODE  ?= $(shell command -v deadcode 2>/dev/null || echo $(HOME)/go/bin/deadcode)

.PHONY: all build demo test test-loaded e2e-loaded lint unit e2e e2e-kube e2e-cluster h2spec fuzz bench bench-quick bench-compare bench-scale bench-fairness bench-stress soak install clean tools image-overlay test-images test-openrc agent-image

all: build

build:
	$(GOBUILD) -o $(BIN) .

demo: build
	./$(BIN) demo

tools:
	@test -x "$(STATICCHECK)" || $(GO) install honnef.co/go/tools/cmd/staticcheck@v0.8.2
	@test -x "$(DEADCODE)" || $(GO) install golang.org/x/tools/cmd/deadcode@v0.51.0

lint: tools
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
		if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) mod tidy -diff
	cd e2e && $(GO) mod tidy -diff
	cd e2e/upstream && $(GO) mod tidy -diff
	$(GO) vet ./...
	$(STATICCHECK) ./...
	@# A function only tests reach is code the product does not use; the
	@# test-support packages are for tests alone.
	@out=$$($(DEADCODE) ./...) || exit 1; out=$$(echo "$$out" | grep -v '^internal/testnet/\|^internal/testpki/\|^tunnel/internal/tunneltest/'); \
		if [ -n "$$out" ]; then echo "reachable from no command (deadcode):"; echo "$$out"; exit 1; fi
	cd e2e && $(GO) vet ./...
	cd e2e/kube && $(GO) vet ./...
	cd e2e/kube && $(STATICCHECK) ./...
	$(GO) vet ./openrc/testdata/testhelper
	$(STATICCHECK) ./openrc/testdata/testhelper
	@out=$$(gofmt -l openrc/testdata); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

unit: build
	$(GO) test -race -count=1 -timeout 10m ./tunnel/... ./auth/... ./certs/... ./internal/...
	$(GO) test -count=1 -timeout 2m -run 'TestIdleTunnelStacksShrink|TestIdleGRPCTunnelsHoldNoBuffer' ./tunnel/server/
	$(GO) test -count=1 -timeout 2m -run 'TestTrimMemoryShrinksParkedStacks' ./internal/daemon/
	$(GO) test -count=1 -timeout 5m .
	KONNECTIVITY_BIN=$(CURDIR)/$(BIN) $(GO) test -count=1 -timeout 5m ./images/ociimage/

e2e: build
	cd e2e && KONNECTIVITY_BIN=$(CURDIR)/$(BIN) $(GO) test -count=1 -timeout 10m -skip '^(TestKubeAPIServer|TestRealCluster)$$' ./...

# The server under a real kube-apiserver and etcd (built from e2e/kube, a
# nested module; the first build takes minutes, later ones reuse the Go
# build cache). Needs root for a private network namespace (unshare) and
# iproute2; .ci/run installs them.
e2e-kube: build
	cd e2e && KONNECTIVITY_BIN=$(CURDIR)/$(BIN) $(GO) test -count=1 -timeout 75m -run '^TestKubeAPIServer$$' -v .

# The server on the host and as a static pod, the agent as the shipped
# DaemonSet, webhooks and workloads in pods: a real kubelet, containerd,
# runc and bridge CNI with kube-scheduler and kube-controller-manager (built
# from e2e/kube like kube-apiserver), all in one private mount, network and
# PID namespace. Needs root, containerd, runc, containernetworking-plugins
# and iproute2; .ci/run installs them.
e2e-cluster: agent-image
	cd e2e && KONNECTIVITY_BIN=$(CURDIR)/$(BIN) AGENT_IMAGE=$(CURDIR)/$(AGENT_IMAGE) $(GO) test -count=1 -timeout 75m -run '^TestRealCluster$$' -v .

# HTTP/2 conformance of the link's serving end (also part of e2e): RELIABILITY.md, "HTTP/2 conformance".
h2spec: build
	cd e2e && KONNECTIVITY_BIN=$(CURDIR)/$(BIN) $(GO) test -count=1 -timeout 5m -run '^TestH2Spec$$' ./

OVERLAY          ?= bin/eks-node-overlay.tar.gz
AGENT_IMAGE      ?= bin/konnectivity-agent-image.tar
AGENT_IMAGE_REPO ?= spinifex/konnectivity-agent

# An OCI image archive of the agent, written without Docker (images/ociimage).
agent-image: build
	$(GO) run ./images/ociimage -bin $(BIN) -tag $(AGENT_IMAGE_REPO):$(VERSION) \
		-version $(VERSION) -revision $(REVISION) -out $(AGENT_IMAGE)

image-overlay: agent-image
	images/build-overlay.sh $(OVERLAY) $(BIN) $(AGENT_IMAGE)

test-images: agent-image
	KONNECTIVITY_BIN=$(CURDIR)/$(BIN) AGENT_IMAGE=$(CURDIR)/$(AGENT_IMAGE) images/test.sh

# Runs the init scripts under real openrc-run and supervise-daemon in private
# namespaces; needs root, openrc, busybox-static and shellcheck (.ci/run installs them).
test-openrc: build
	KONNECTIVITY_BIN=$(CURDIR)/$(BIN) openrc/test.sh

test: lint unit e2e e2e-kube e2e-cluster test-images test-openrc agent-image

# A test must pass on a busy machine (a shared CI runner, a laptop doing
# other work): one that fails only there found a race in the product or
# waits for time instead of an event. These run a target beside one more
# CPU-bound process than the machine has cores (stress-ng --cpu, else yes),
# which end with the run however it ends. Not part of make test.
LOADED_TARGET ?= test
test-loaded:
	@n=$$(( $$(nproc) + 1 )); hogs=; \
	if command -v stress-ng >/dev/null 2>&1; then \
		stress-ng --cpu $$n --timeout 4h --quiet & hogs=$$!; \
	else \
		for i in $$(seq $$n); do yes >/dev/null & hogs="$$hogs $$!"; done; \
	fi; \
	trap 'kill $$hogs 2>/dev/null' EXIT; trap 'exit 130' INT TERM HUP; \
	echo "== make $(LOADED_TARGET) beside $$n CPU hogs"; \
	$(MAKE) $(LOADED_TARGET); rc=$$?; exit $$rc

e2e-loaded:
	@$(MAKE) test-loaded LOADED_TARGET=e2e

FUZZTIME ?= 20s
fuzz:
	@for pkg in ./tunnel/wire/ ./tunnel/agent/ ./tunnel/server/ ./tunnel/internal/h2link/ ./tunnel/internal/grpcwire/; do for target in $$($(GO) test -list 'Fuzz.*' $$pkg | grep ^Fuzz); do \
		echo "== $$pkg $$target"; $(GO) test -run '^$$' -fuzz "^$$target$$" -fuzztime $(FUZZTIME) -fuzzminimizetime 5s $$pkg || exit 1; done; done
	@for pkg in ./certs/ ./images/ociimage/ ./internal/kubeclient/ ./internal/lease/ ./internal/nodemap/ ./internal/proxydial/; do for target in $$($(GO) test -list 'Fuzz.*' $$pkg | grep ^Fuzz); do \
		echo "== $$pkg $$target"; $(GO) test -run '^$$' -fuzz "^$$target$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; done; done

bench: build
	cd e2e && $(GO) run ./bench --bin $(CURDIR)/$(BIN) $(BENCHFLAGS)
	cd e2e && $(GO) run ./bench --bin $(CURDIR)/$(BIN) --frontend grpc --bytes 268435456 --phases latency,throughput
	$(GO) test -run '^$$' -bench 'FullMesh|IdleAgents' -benchtime 1x -timeout 10m ./tunnel/server/

# Runs the same bench against another implementation taking the upstream flags:
# OTHER=dir holding proxy-server and proxy-agent (upstream's binaries), or
# OTHER=path of another konnectivity binary.
bench-compare: build
	@test -n "$(OTHER)" || { echo "usage: make bench-compare OTHER=path"; exit 2; }
	@echo "== konnectivity ($(BIN))"
	cd e2e && $(GO) run ./bench --bin $(CURDIR)/$(BIN) $(BENCHFLAGS)
	@echo "== other ($(OTHER))"
	@if [ -d "$(OTHER)" ]; then \
		cd e2e && $(GO) run ./bench --server-bin $(abspath $(OTHER))/proxy-server --agent-bin $(abspath $(OTHER))/proxy-agent $(BENCHFLAGS); \
	else \
		cd e2e && $(GO) run ./bench --bin $(abspath $(OTHER)) $(BENCHFLAGS); \
	fi

# One server, AGENTS agents (the product's agent code, in-process, each with
# its own TLS connection and link) and TUNNELS idle tunnels, through both
# front doors: time until the fleet is connected, server RSS per agent and
# per tunnel, idle CPU, dial p50/p99 against the 1-agent figure. OTHER= runs
# the same against another server: a directory holding upstream's
# proxy-server (its agents then speak upstream's agent protocol, in-process
# as ours are), or the path of another konnectivity binary.
AGENTS  ?= 5000
TUNNELS ?= 50000
bench-scale: build
	cd e2e && $(GO) run ./scale --bin $(CURDIR)/$(BIN) --agents $(AGENTS) --tunnels $(TUNNELS) $(if $(OTHER),--other $(abspath $(OTHER))) $(SCALEFLAGS)

# A probe tunnel's 64-byte echoes, alone and beside bulk tunnels, on a veth
# between two network namespaces shaped with tc tbf and through a relay that
# holds every byte 10 or 25 ms each way (docs/slow-links.md). OTHER= runs the
# same against another build in the same run: a directory holding upstream's
# proxy-server and proxy-agent, or the path of another konnectivity binary.
# Needs root.
bench-fairness: build
	cd e2e && $(GO) run ./fairness --bin $(CURDIR)/$(BIN) $(if $(OTHER),--other $(abspath $(OTHER))) $(FAIRFLAGS)

# STRESS_TUNNELS tunnels through one server and one agent, opened first and
# then all moving STRESS_BYTES at once (echoed both ways, or one way:
# STRESS_SHAPES), with STRESS_HOGS CPU hogs beside them for STRESS_HOG_FOR:
# completed, errors, wall time, bytes per second, peak RSS of both ends and
# the longest time a tunnel went without progress (BENCHMARKS.md, "Under
# load"). OTHER= runs the same against another build in the same run: a
# directory holding upstream's proxy-server and proxy-agent, or the path of
# another konnectivity binary. STRESS_DESTINATIONS is where the destinations
# listen: pod (a network namespace behind a veth of MTU 1500, as a node's
# pods; needs root) or loopback. Not part of make test (its small form is).
STRESS_TUNNELS ?= 2000
STRESS_BYTES   ?= 5242880
STRESS_SHAPES  ?= echo,download,upload
STRESS_HOGS    ?= 2
STRESS_HOG_FOR ?= 40s
STRESS_RUNS    ?= 1
STRESS_DESTINATIONS ?= pod
bench-stress: build
	cd e2e && $(GO) run ./stress --bin $(CURDIR)/$(BIN) --tunnels $(STRESS_TUNNELS) --bytes $(STRESS_BYTES) \
		--shapes $(STRESS_SHAPES) --hogs $(STRESS_HOGS) --hog-for $(STRESS_HOG_FOR) --runs $(STRESS_RUNS) \
		--destinations $(STRESS_DESTINATIONS) $(if $(OTHER),--other $(abspath $(OTHER))) $(STRESSFLAGS)

# A bounded mixed workload (short dials, long checksummed streams, server
# SIGHUPs, agent churn) that fails on any lost byte or leak.
DURATION ?= 10m
soak: build
	cd e2e && $(GO) run ./soak --bin $(CURDIR)/$(BIN) --duration $(DURATION)

bench-quick: build
	cd e2e && $(GO) run ./bench --bin $(CURDIR)/$(BIN) --quick

install: build
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 0755 $(BIN) $(DESTDIR)$(PREFIX)/bin/konnectivity
	for name in $(ALIASES); do ln -sf konnectivity $(DESTDIR)$(PREFIX)/bin/$$name; done

clean:
	rm -rf bin
