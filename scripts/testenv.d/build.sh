# shellcheck shell=bash
# The control plane, the node's runtime and KubeRay, built from the Go module proxy into the cache
# (sourced by scripts/testenv). Each piece is one `go build` in a throwaway wrapper module, once per
# version: the cache keeps the binaries, Go's own build cache the packages they share.
#
#   Kubernetes   $KUBE_VERSION (default 1.35.4; MOE_KUBE_VERSION to change): kube-apiserver, kubelet,
#                kube-proxy, kube-scheduler, kube-controller-manager, kubectl -> $CACHE/kube/v$KUBE_VERSION
#   etcd         $ETCD_VERSION, the release Kubernetes 1.35 is tested with
#   containerd   $CONTAINERD_VERSION (containerd, containerd-shim-runc-v2, ctr), runc $RUNC_VERSION
#                (cgo, with seccomp), the CNI plugins $CNI_VERSION (bridge, host-local, loopback, portmap)
#   CoreDNS      $COREDNS_VERSION with the bind, errors and kubernetes plugins only: the node's
#                cluster DNS (KubeRay addresses a Ray head by its Service's name)
#   KubeRay      ray-operator $KUBERAY_VERSION, and its CRDs and RBAC as the module ships them
#
# k8s.io/kubernetes replaces each staging module (k8s.io/api, ...) with a path inside its own tree, so
# `go install` cannot build it: the wrapper requires it and replaces each of those with the published
# v0.MINOR.PATCH of the same name, read from k8s.io/kubernetes' own go.mod.

KUBE_VERSION=${MOE_KUBE_VERSION:-1.35.4}
ETCD_VERSION=3.6.16
CONTAINERD_VERSION=2.2.9
RUNC_VERSION=1.4.4
CNI_VERSION=1.9.1
KUBERAY_VERSION=1.5.0
COREDNS_VERSION=1.14.7
KUBE_BIN="$CACHE/kube/v$KUBE_VERSION"
KUBE_BINARIES="kube-apiserver kubelet kube-proxy kube-scheduler kube-controller-manager kubectl"
CNI_BIN="$CACHE/cni"
CNI_PLUGINS="main/bridge ipam/host-local main/loopback meta/portmap"
KUBERAY_DIR="$CACHE/kuberay/v$KUBERAY_VERSION"   # bin/ray-operator, crd/, rbac/

go_env() { env GOFLAGS=-mod=mod GOTOOLCHAIN=local "$@"; }

wrapper_module() { # dir module-path: a fresh directory holding an empty go.mod
  rm -rf "$1"; mkdir -p "$1"
  printf 'module %s\n\ngo 1.25.0\n' "$2" >"$1/go.mod"
}

timed() { # what logfile command...: run it, its output to logfile, and log how long it took
  local what=$1 logf=$2 t0=$SECONDS; shift 2
  "$@" >"$logf" 2>&1 || return 1
  log "$what built in $((SECONDS - t0)) s"
}

build_kube() {
  local b missing=()
  for b in $KUBE_BINARIES; do [ -x "$KUBE_BIN/$b" ] || missing+=("$b"); done
  [ ${#missing[@]} -eq 0 ] && [ -x "$BIN/pause" ] && return 0
  command -v go >/dev/null || die "Go is needed to build Kubernetes (the machine's go, or apt-get install golang)"
  local work="$CACHE/build/kube-$KUBE_VERSION" minor=${KUBE_VERSION#*.}; minor=${minor%%.*}
  wrapper_module "$work" moe-operator.local/testenv-kube
  local mod src
  read -r mod src < <(cd "$work" && go_env go mod download -json "k8s.io/kubernetes@v$KUBE_VERSION" |
    python3 -c 'import json,sys; m=json.load(sys.stdin); print(m["GoMod"], m["Dir"])') ||
    die "k8s.io/kubernetes v$KUBE_VERSION is not served"
  if [ ! -x "$BIN/pause" ]; then  # the node's sandbox ("pause") image runs this, from the same module
    mkdir -p "$BIN"; gcc -Os -static -o "$BIN/pause" "$src/build/pause/linux/pause.c" || die "gcc of pause.c failed"
  fi
  [ ${#missing[@]} -eq 0 ] && { rm -rf "$work"; return 0; }
  log "building ${missing[*]} v$KUBE_VERSION from the Go module proxy (minutes, once)"
  # every staging module -> its published release of the same minor
  awk -v v="v0.${KUBE_VERSION#*.}" '$2 == "=>" && $3 ~ /^\.\/staging\// {print "replace " $1 " => " $1 " " v}' \
    "$mod" >>"$work/go.mod"
  local pkgs=() ldflags="-s -w" p
  for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=v$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  (cd "$work" && go_env go get "${pkgs[@]/%/@v$KUBE_VERSION}" >"$work/get.log" 2>&1) ||
    { tail -n 20 "$work/get.log" >&2; die "go get k8s.io/kubernetes v$KUBE_VERSION failed"; }
  mkdir -p "$work/out"
  (cd "$work" && timed "Kubernetes v$KUBE_VERSION (${missing[*]})" "$work/build.log" go_env CGO_ENABLED=0 go build -trimpath \
    -ldflags "$ldflags" -o "$work/out/" "${pkgs[@]}") ||
    { tail -n 30 "$work/build.log" >&2; die "build of Kubernetes v$KUBE_VERSION failed (log: $work/build.log)"; }
  mkdir -p "$KUBE_BIN"
  for b in "${missing[@]}"; do mv "$work/out/$b" "$KUBE_BIN/$b"; done
  rm -rf "$work"
}

build_etcd() {
  [ -x "$BIN/etcd" ] && "$BIN/etcd" --version 2>/dev/null | grep -q "etcd Version: $ETCD_VERSION" && return 0
  log "building etcd v$ETCD_VERSION from the Go module proxy"
  local work="$CACHE/build/etcd"
  wrapper_module "$work" moe-operator.local/testenv-etcd
  # the server module's main, as etcd's own binary runs it
  cat >"$work/main.go" <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  (cd "$work" && go_env go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION" >"$work/get.log" 2>&1 &&
    timed "etcd v$ETCD_VERSION" "$work/build.log" go_env CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$work/etcd" . \
   ) || { tail -n 30 "$work"/*.log >&2; die "build of etcd v$ETCD_VERSION failed"; }
  mkdir -p "$BIN"; mv "$work/etcd" "$BIN/etcd"; rm -rf "$work"
}

build_containerd() {
  if [ -x "$BIN/containerd" ] && [ -x "$BIN/containerd-shim-runc-v2" ] && [ -x "$BIN/ctr" ] &&
      "$BIN/containerd" --version 2>/dev/null | grep -q " v$CONTAINERD_VERSION "; then
    :
  else
    log "building containerd v$CONTAINERD_VERSION from the Go module proxy"
    local work="$CACHE/build/containerd" m=github.com/containerd/containerd/v2
    wrapper_module "$work" moe-operator.local/testenv-containerd
    (cd "$work" && go_env go get "$m/cmd/containerd@v$CONTAINERD_VERSION" "$m/cmd/ctr@v$CONTAINERD_VERSION" \
        "$m/cmd/containerd-shim-runc-v2@v$CONTAINERD_VERSION" >"$work/get.log" 2>&1 &&
      timed "containerd v$CONTAINERD_VERSION" "$work/build.log" go_env CGO_ENABLED=0 go build -trimpath \
        -tags "no_btrfs no_devmapper no_zfs no_aufs" \
        -ldflags "-s -w -X $m/version.Version=v$CONTAINERD_VERSION -X $m/version.Package=$m" \
        -o "$work/out/" "$m/cmd/containerd" "$m/cmd/ctr" "$m/cmd/containerd-shim-runc-v2") ||
      { tail -n 30 "$work"/*.log >&2; die "build of containerd v$CONTAINERD_VERSION failed"; }
    mkdir -p "$BIN"; mv "$work"/out/* "$BIN/"; rm -rf "$work"
  fi
  if ! { [ -x "$BIN/runc" ] && "$BIN/runc" --version 2>/dev/null | grep -q "runc version $RUNC_VERSION"; }; then
    log "building runc v$RUNC_VERSION (cgo, seccomp) from the Go module proxy"
    apt_install gcc libc6-dev libseccomp-dev pkg-config
    local work="$CACHE/build/runc"
    wrapper_module "$work" moe-operator.local/testenv-runc
    (cd "$work" && go_env go get "github.com/opencontainers/runc@v$RUNC_VERSION" >"$work/get.log" 2>&1 &&
      timed "runc v$RUNC_VERSION" "$work/build.log" go_env CGO_ENABLED=1 go build -trimpath -tags "seccomp urfave_cli_no_docs" \
        -ldflags "-s -w -X main.version=$RUNC_VERSION" -o "$work/runc" github.com/opencontainers/runc \
       ) || { tail -n 30 "$work"/*.log >&2; die "build of runc v$RUNC_VERSION failed"; }
    mkdir -p "$BIN"; mv "$work/runc" "$BIN/runc"; rm -rf "$work"
  fi
  local p missing=()
  for p in $CNI_PLUGINS; do [ -x "$CNI_BIN/${p#*/}" ] || missing+=("github.com/containernetworking/plugins/plugins/$p"); done
  if [ ${#missing[@]} -gt 0 ] || [ "$(cat "$CNI_BIN/VERSION" 2>/dev/null)" != "$CNI_VERSION" ]; then
    log "building the CNI plugins v$CNI_VERSION from the Go module proxy"
    missing=(); for p in $CNI_PLUGINS; do missing+=("github.com/containernetworking/plugins/plugins/$p"); done
    local work="$CACHE/build/cni"
    wrapper_module "$work" moe-operator.local/testenv-cni
    (cd "$work" && go_env go get "github.com/containernetworking/plugins@v$CNI_VERSION" >"$work/get.log" 2>&1 &&
      timed "CNI plugins v$CNI_VERSION" "$work/build.log" go_env CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$work/out/" \
        "${missing[@]}") || { tail -n 30 "$work"/*.log >&2; die "build of the CNI plugins failed"; }
    rm -rf "$CNI_BIN"; mkdir -p "$CNI_BIN"; mv "$work"/out/* "$CNI_BIN/"; echo "$CNI_VERSION" >"$CNI_BIN/VERSION"
    rm -rf "$work"
  fi
}

build_kuberay() { # ray-operator and, beside it, the CRDs and RBAC of the same module version
  [ -x "$KUBERAY_DIR/bin/ray-operator" ] && [ -d "$KUBERAY_DIR/crd" ] && return 0
  log "building KubeRay's ray-operator v$KUBERAY_VERSION from the Go module proxy"
  local work="$CACHE/build/kuberay" m=github.com/ray-project/kuberay/ray-operator
  wrapper_module "$work" moe-operator.local/testenv-kuberay
  local dir
  (cd "$work" && go_env go get "$m@v$KUBERAY_VERSION" >"$work/get.log" 2>&1 &&
    timed "KubeRay v$KUBERAY_VERSION" "$work/build.log" go_env CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$work/ray-operator" "$m" \
     ) || { tail -n 30 "$work"/*.log >&2; die "build of KubeRay v$KUBERAY_VERSION failed"; }
  dir=$(cd "$work" && go_env go list -m -f '{{.Dir}}' "$m")
  rm -rf "$KUBERAY_DIR"; mkdir -p "$KUBERAY_DIR/bin" "$KUBERAY_DIR/crd" "$KUBERAY_DIR/rbac"
  mv "$work/ray-operator" "$KUBERAY_DIR/bin/"
  cp "$dir"/config/crd/bases/*.yaml "$KUBERAY_DIR/crd/"
  cp "$dir"/config/rbac/role.yaml "$KUBERAY_DIR/rbac/"
  chmod -R u+w "$KUBERAY_DIR"
  rm -rf "$work"
}

build_coredns() { # CoreDNS' main with the plugins the node's Corefile uses (bind, errors, kubernetes)
  [ -x "$BIN/coredns" ] && "$BIN/coredns" -plugins 2>/dev/null | grep -qx bind &&
    "$BIN/coredns" -version 2>/dev/null | grep -q "CoreDNS-$COREDNS_VERSION" && return 0
  log "building CoreDNS v$COREDNS_VERSION (kubernetes plugin) from the Go module proxy"
  local work="$CACHE/build/coredns" m=github.com/coredns/coredns
  wrapper_module "$work" moe-operator.local/testenv-coredns
  cat >"$work/main.go" <<'GO'
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/core/dnsserver"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
)

func main() { coremain.Run() }
GO
  (cd "$work" && go_env go get "$m@v$COREDNS_VERSION" >"$work/get.log" 2>&1 &&
    timed "CoreDNS v$COREDNS_VERSION" "$work/build.log" go_env CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" \
      -o "$work/coredns" .) || { tail -n 30 "$work"/*.log >&2; die "build of CoreDNS v$COREDNS_VERSION failed"; }
  mkdir -p "$BIN"; mv "$work/coredns" "$BIN/coredns"; rm -rf "$work"
}
