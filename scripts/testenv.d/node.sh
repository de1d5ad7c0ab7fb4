# shellcheck shell=bash
# A real node beside the control plane: containerd 2 + runc + CNI bridge, kubelet, kube-proxy,
# kube-scheduler and kube-controller-manager, all built by testenv.d/build.sh (sourced by
# scripts/testenv).
#
# The kubelet runs on the host's cgroups with the cgroupfs driver. Where the host mounts cgroup v1
# (these VMs: v1 controllers, an empty unified hierarchy), Kubernetes 1.35's kubelet refuses to
# start unless told otherwise: the node's KubeletConfiguration sets failCgroupV1: false there,
# and leaves it at the default on a cgroup v2 host.
#
# Addresses stay inside the machine: Pods on a bridge of their own (198.18.0.0/24, gateway
# 198.18.0.1, no masquerade), Services in 198.19.0.0/24. The apiserver, the kubelet and the
# cluster DNS (CoreDNS, its kubernetes plugin: <svc>.<ns>.svc.cluster.local, nothing outside the
# cluster) listen on the bridge's address only.
#
# Everything the node changes on the host is recorded in DIR/node/ when it is made, and `stop`
# undoes exactly that: processes by pid, containers, mounts, network namespaces, the bridge, the
# iptables chains, cgroups, sysctls and the directories the kubelet hard-codes. One node per
# machine (the bridge, the kubelet's port and /var/lib/kubelet/device-plugins are host-wide).

NODE_NAME=moe-node
NODE_BRIDGE=moe-br0
NODE_GW=198.18.0.1
NODE_POD_CIDR=198.18.0.0/24
NODE_SERVICE_CIDR=198.19.0.0/24
NODE_DOMAIN=cluster.local
NODE_LOCK=/run/moe-testenv-node
CTRD_STATE=/run/moe-testenv-containerd
CTRD_SOCK=$CTRD_STATE/containerd.sock
CTRD_ROOT="$CACHE/containerd"      # images stay imported between runs (a cache, like the binaries)
NODE_BINARIES="kubelet kube-proxy kube-scheduler kube-controller-manager"
# sysctls the kubelet and kube-proxy may set; restored to what they were
NODE_SYSCTLS="net/ipv4/ip_forward net/ipv4/conf/all/route_localnet net/bridge/bridge-nf-call-iptables
  vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys
  kernel/keys/root_maxbytes"
# host paths the kubelet creates whatever its flags say
NODE_HOST_DIRS="/var/lib/kubelet /var/log/pods /var/log/containers"

install_node_packages() {  # containerd, runc and the CNI plugins are built (build_containerd)
  apt_install iptables conntrack
}

ctr_() { "$BIN/ctr" -a "$CTRD_SOCK" -n k8s.io "$@"; }

cgroup_v2() { [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ]; }

node_prepare_host() { # dir: the bridge first, so the apiserver can listen on its address
  local dir=$1 nd=$1/node s d
  if [ -e "$NODE_LOCK" ]; then
    local owner; owner=$(cat "$NODE_LOCK")
    [ -d "$owner/node" ] && die "a node already runs here (state in $owner); stop it first: scripts/testenv stop $owner"
    as_root rm -f "$NODE_LOCK"
  fi
  mkdir -p "$nd"
  echo "$dir" | as_root tee "$NODE_LOCK" >/dev/null
  for s in $NODE_SYSCTLS; do [ -f "/proc/sys/$s" ] && echo "$s $(cat "/proc/sys/$s")" >>"$nd/sysctls"; done
  for d in $NODE_HOST_DIRS; do [ -e "$d" ] || echo "$d" >>"$nd/host-dirs"; done
  for t in nat filter mangle; do as_root iptables -t "$t" -S | awk '$1=="-N"{print $2}' | sed "s/^/$t /"; done >"$nd/chains-before"
  ls -d /run/netns/cni-* 2>/dev/null >"$nd/netns-before" || true
  ip link show "$NODE_BRIDGE" >/dev/null 2>&1 && die "bridge $NODE_BRIDGE exists already (left by another run?)"
  as_root ip link add "$NODE_BRIDGE" type bridge
  echo "$NODE_BRIDGE" >"$nd/bridge"
  as_root ip addr add "$NODE_GW/24" dev "$NODE_BRIDGE"
  as_root ip link set "$NODE_BRIDGE" up
  as_root sysctl -qw net.ipv4.ip_forward=1
}

node_write_configs() { # dir
  local dir=$1 nd=$1/node
  mkdir -p "$nd/cni/net.d" "$nd/cni/ipam" "$nd/kubelet" "$CTRD_ROOT"
  # containerd 2's configuration schema (version 3: the CRI's image and runtime plugins apart)
  cat >"$nd/containerd.toml" <<TOML
version = 3
root = "$CTRD_ROOT"
state = "$CTRD_STATE"
[grpc]
  address = "$CTRD_SOCK"
[debug]
  level = "warn"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "$PAUSE_IMAGE"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$BIN/runc"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["$CNI_BIN"]
    conf_dir = "$nd/cni/net.d"
TOML
  local fail_v1=true; cgroup_v2 || fail_v1=false
  cat >"$nd/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://$CTRD_SOCK
imageServiceEndpoint: unix://$CTRD_SOCK
runtimeRequestTimeout: 5m
cgroupDriver: cgroupfs
failCgroupV1: $fail_v1
failSwapOn: false
address: $NODE_GW
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 0
# the apiserver reaches the kubelet (logs, exec, port-forward) without a client certificate here;
# the kubelet listens on the node's bridge address only
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
evictionHard: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
makeIPTablesUtilChains: false
serializeImagePulls: false
maxPods: 30
# CPU limits are not enforced (no CFS quota): on a 2-core test node the Pods' shares are fractions
# of a core, and a Ray head throttled to them misses its liveness probes while its processes start;
# requests still decide where Pods fit
cpuCFSQuota: false
clusterDNS: [$NODE_GW]
clusterDomain: $NODE_DOMAIN
YAML
  cat >"$nd/Corefile" <<COREFILE
$NODE_DOMAIN:53 {
    bind $NODE_GW
    errors
    kubernetes $NODE_DOMAIN {
        kubeconfig $nd/kubeconfig
    }
}
.:53 {
    bind $NODE_GW
    errors
}
COREFILE
  cat >"$nd/cni/net.d/10-moe.conflist" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "moe-testenv",
  "plugins": [{
    "type": "bridge", "bridge": "$NODE_BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
    "ipam": {"type": "host-local", "dataDir": "$nd/cni/ipam", "routes": [{"dst": "0.0.0.0/0"}],
             "ranges": [[{"subnet": "$NODE_POD_CIDR", "rangeStart": "198.18.0.10", "gateway": "$NODE_GW"}]]}
  }]
}
JSON
}

node_start() { # dir server token
  local dir=$1 server=$2 token=$3 nd=$1/node
  for b in $NODE_BINARIES; do [ -x "$KUBE_BIN/$b" ] || die "$b v$KUBE_VERSION not installed; run: scripts/testenv install"; done
  for b in containerd containerd-shim-runc-v2 ctr runc coredns; do
    [ -x "$BIN/$b" ] || die "$b not installed; run: scripts/testenv install"
  done
  node_write_configs "$dir"
  write_kubeconfig "$nd/kubeconfig" "$server" admin "$token"
  # the shim is found on containerd's PATH
  $SUDO env PATH="$BIN:$PATH" "$BIN/containerd" --config "$nd/containerd.toml" >"$nd/containerd.log" 2>&1 &
  echo $! >>"$dir/pids"
  local i
  for ((i = 0; i < 100; i++)); do [ -S "$CTRD_SOCK" ] && ctr_ version >/dev/null 2>&1 && break; sleep 0.1; done
  ctr_ version >/dev/null 2>&1 || { tail -n 20 "$nd/containerd.log" >&2; die "containerd did not start"; }
  images_import_pause
  "$BIN/coredns" -conf "$nd/Corefile" >"$nd/coredns.log" 2>&1 &
  echo $! >>"$dir/pids"

  $SUDO "$KUBE_BIN/kubelet" --config "$nd/kubelet.yaml" --kubeconfig "$nd/kubeconfig" \
    --root-dir "$nd/kubelet" --cert-dir "$nd/kubelet/pki" --volume-plugin-dir "$nd/kubelet/volume-plugins" \
    --hostname-override "$NODE_NAME" --node-ip "$NODE_GW" >"$nd/kubelet.log" 2>&1 &
  echo $! >>"$dir/pids"; echo $! >"$nd/kubelet.pid"
  $SUDO "$KUBE_BIN/kube-proxy" --kubeconfig "$nd/kubeconfig" --hostname-override "$NODE_NAME" \
    --proxy-mode iptables --cluster-cidr "$NODE_POD_CIDR" --bind-address "$NODE_GW" \
    --healthz-bind-address "127.0.0.1:$(free_port)" --metrics-bind-address "127.0.0.1:$(free_port)" \
    --conntrack-max-per-core 0 --conntrack-tcp-timeout-established 0 --conntrack-tcp-timeout-close-wait 0 \
    >"$nd/kube-proxy.log" 2>&1 &
  echo $! >>"$dir/pids"
  "$KUBE_BIN/kube-scheduler" --kubeconfig "$nd/kubeconfig" --leader-elect=false --secure-port 0 \
    >"$nd/kube-scheduler.log" 2>&1 &
  echo $! >>"$dir/pids"
  "$KUBE_BIN/kube-controller-manager" --kubeconfig "$nd/kubeconfig" --leader-elect=false --secure-port 0 \
    --service-account-private-key-file "$dir/certs/sa.key" --root-ca-file "$dir/certs/apiserver.crt" \
    --use-service-account-credentials=false --controllers '*,-csrsigning,-csrapproving,-csrcleaner' \
    >"$nd/kube-controller-manager.log" 2>&1 &
  echo $! >>"$dir/pids"

  local kc=(env KUBECONFIG="$nd/kubeconfig" "$KUBE_BIN/kubectl")
  for ((i = 0; i < 600; i++)); do
    [ "$("${kc[@]}" get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ] &&
      "${kc[@]}" get sa default >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  tail -n 20 "$nd/kubelet.log" >&2
  die "node $NODE_NAME not Ready after 120 s (logs in $nd)"
}

node_stop() { # dir: undo what node_prepare_host/node_start did; harmless twice
  local dir=$1 nd=$1/node
  [ -d "$nd" ] || return 0
  # the kubelet first (it would restart what we stop), then, while containerd still answers, every
  # task and container (their shims outlive containerd otherwise)
  if [ -f "$nd/kubelet.pid" ]; then
    local k; k=$(cat "$nd/kubelet.pid")
    kill "$k" 2>/dev/null || true
    for _ in $(seq 50); do alive "$k" || break; sleep 0.1; done
    alive "$k" && kill -9 "$k" 2>/dev/null || true
    rm -f "$nd/kubelet.pid"
  fi
  if [ -S "$CTRD_SOCK" ] && ctr_ version >/dev/null 2>&1; then
    local c
    for c in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s SIGKILL "$c" >/dev/null 2>&1 || true; done
    for c in $(ctr_ tasks ls -q 2>/dev/null); do
      for _ in $(seq 50); do ctr_ tasks rm "$c" >/dev/null 2>&1 && break; sleep 0.1; done
    done
    for c in $(ctr_ containers ls -q 2>/dev/null); do ctr_ containers rm "$c" >/dev/null 2>&1 || true; done
  fi
}

node_kill_shims() { # shims left when containerd could not be asked (crashed): their tasks, then them
  local p c
  for p in $(pgrep -f -- "-address $CTRD_SOCK" || true); do
    for c in $(pgrep -P "$p" || true); do as_root kill -9 "$c" 2>/dev/null || true; done
    as_root kill "$p" 2>/dev/null || true
  done
}

node_cleanup_host() { # dir: after the node's processes are gone
  local dir=$1 nd=$1/node m ns
  [ -d "$nd" ] || return 0
  node_kill_shims
  # mounts under the kubelet's root and containerd's state (pod volumes, rootfs, shm), deepest first
  for m in $(awk -v a="$nd/" -v b="$CTRD_STATE/" -v c="$CTRD_ROOT/" \
      'index($5, a) == 1 || $5 == substr(a, 1, length(a) - 1) "/kubelet" || index($5, b) == 1 || index($5, c) == 1 {print $5}' \
      /proc/self/mountinfo | sort -r); do
    as_root umount -l "$m" 2>/dev/null || true
  done
  for ns in /run/netns/cni-*; do
    [ -e "$ns" ] || continue
    grep -qx "$ns" "$nd/netns-before" 2>/dev/null || as_root ip netns delete "$(basename "$ns")" 2>/dev/null || true
  done
  if [ -f "$nd/bridge" ]; then as_root ip link delete "$(cat "$nd/bridge")" 2>/dev/null || true; rm -f "$nd/bridge"; fi
  [ -x "$KUBE_BIN/kube-proxy" ] && as_root "$KUBE_BIN/kube-proxy" --cleanup >/dev/null 2>&1 || true
  node_remove_chains "$nd"
  local cg
  for cg in /sys/fs/cgroup/*/kubepods; do
    [ -d "$cg" ] && as_root find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  if [ -f "$nd/sysctls" ]; then
    local s v
    while read -r s v; do [ "$(cat "/proc/sys/$s" 2>/dev/null)" = "$v" ] || echo "$v" | as_root tee "/proc/sys/$s" >/dev/null 2>&1 || true; done <"$nd/sysctls"
    rm -f "$nd/sysctls"
  fi
  if [ -f "$nd/host-dirs" ]; then
    local d; while read -r d; do as_root rm -rf "$d"; done <"$nd/host-dirs"; rm -f "$nd/host-dirs"
  fi
  as_root rm -rf "$CTRD_STATE" "$nd/kubelet"
  [ "$(cat "$NODE_LOCK" 2>/dev/null)" = "$dir" ] && as_root rm -f "$NODE_LOCK"
  rm -rf "$nd"
}

node_remove_chains() { # node dir: the KUBE-* and CNI-* chains that were not there before start
  local nd=$1 t rule chain
  for t in nat filter mangle; do
    local new=()
    for chain in $(as_root iptables -t "$t" -S | awk '$1=="-N"{print $2}' | grep -E '^(KUBE|CNI)-'); do
      grep -qx "$t $chain" "$nd/chains-before" 2>/dev/null || new+=("$chain")
    done
    [ ${#new[@]} -eq 0 ] && continue
    # jumps into them from any chain, then the chains themselves
    for chain in "${new[@]}"; do
      { as_root iptables -t "$t" -S | grep -E -- "-j $chain( |$)" || true; } | while read -r rule; do
        eval "as_root iptables -t $t ${rule/-A /-D }" 2>/dev/null || true  # eval: rules hold quoted comments
      done
    done
    for chain in "${new[@]}"; do as_root iptables -t "$t" -F "$chain" 2>/dev/null || true; done
    for chain in "${new[@]}"; do as_root iptables -t "$t" -X "$chain" 2>/dev/null || true; done
  done
}
