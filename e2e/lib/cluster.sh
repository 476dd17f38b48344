# shellcheck shell=bash
# A single-node (or two-node) Kubernetes on this machine: etcd, the control
# plane, containerd and a kubelet per node, every process started here, tracked
# by PID, and stopped at teardown. Nothing listens beyond loopback and the
# machine's own address; pods live on a bridge of their own with no route out.
#
# Needs: W (the work directory), BIN_K8S, BIN_ETCD, BIN_CONTAINERD, HOST_IP;
# log and die of scripts/preamble.sh.

SERVICE_CIDR=10.96.0.0/24
SERVICE_IP=10.96.0.1
POD_CIDR_BASE=10.244     # node i gets 10.244.i.0/24 on bridge e2e-br<i>
APISERVER_PORT=6443
# Alpha: the kubelet asks the driver for volume and storage health and writes
# it into Pod.status.volumeHealth and CSINode.status.storageHealth (the API
# server keeps those fields only with the gate on).
FEATURE_GATES=CSIVolumeHealth=true

# host_ip: the machine's own address (not loopback), the node IP of the kubelets.
host_ip() {
    ip -4 -o addr show scope global | awk '{split($4, a, "/"); print a[1]; exit}'
}

# start_bg NAME CMD...: runs CMD in the background, logging to $W/logs/NAME.log,
# and records its PID for teardown and its command for start_again.
start_bg() {
    local name=$1; shift
    mkdir -p "$W/logs"
    printf '%q ' "$@" >"$W/cmd-$name"
    setsid "$@" >>"$W/logs/$name.log" 2>&1 </dev/null &
    echo "$! $name" >>"$W/pids"
    # the shell does not report it when a chaos scenario kills it
    disown "$!"
}

# start_again NAME: the command last started as NAME, started again (after
# stop_pids NAME, as a service manager restarts a service).
start_again() {
    local cmd; cmd=$(cat "$W/cmd-$1") || return 1
    eval "start_bg $(printf '%q' "$1") $cmd"
}

# pid_of NAME: the PID of the process last started as NAME.
pid_of() { awk -v n="$1" '$2 == n {p = $1} END {print p}' "$W/pids"; }

# wait_for SECONDS WHAT CMD...: retries CMD every half second until it succeeds.
wait_for() {
    local secs=$1 what=$2; shift 2
    local end=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -ge $end ] && { log "timed out after ${secs}s waiting for $what"; return 1; }
        sleep 0.5
    done
}

kc() { "$BIN_K8S/kubectl" --kubeconfig "$W/admin.kubeconfig" "$@"; }
ctr_() { "$BIN_CONTAINERD/ctr" "$@"; }

start_control_plane() {
    local pki=$W/pki
    pki_make "$pki" "$HOST_IP" "$SERVICE_IP" "${NODES[@]}"
    local server="https://$HOST_IP:$APISERVER_PORT"
    kubeconfig "$W/admin.kubeconfig" "$server" "$pki" admin
    kubeconfig "$W/controller-manager.kubeconfig" "$server" "$pki" controller-manager
    kubeconfig "$W/scheduler.kubeconfig" "$server" "$pki" scheduler
    local n
    for n in "${NODES[@]}"; do kubeconfig "$W/kubelet-$n.kubeconfig" "$server" "$pki" "kubelet-$n"; done

    log "starting etcd"
    start_bg etcd "$BIN_ETCD/etcd" --data-dir "$W/etcd" --name e2e \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster e2e=http://127.0.0.1:2380 --log-level warn
    wait_for 60 etcd curl -sf http://127.0.0.1:2379/health || die "etcd did not start (logs/etcd.log)"

    log "starting kube-apiserver (NodeRestriction on)"
    start_bg kube-apiserver "$BIN_K8S/kube-apiserver" \
        --etcd-servers=http://127.0.0.1:2379 \
        --bind-address="$HOST_IP" --advertise-address="$HOST_IP" --secure-port=$APISERVER_PORT \
        --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
        --client-ca-file="$pki/ca.crt" \
        --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
        --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
        --kubelet-preferred-address-types=InternalIP \
        --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
        --allow-privileged=true \
        --service-cluster-ip-range=$SERVICE_CIDR \
        --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
        --service-account-issuer=https://kubernetes.default.svc \
        --feature-gates="$FEATURE_GATES" --profiling=false --v=1
    apiserver_ready || die "kube-apiserver did not become ready (logs/kube-apiserver.log)"

    log "starting kube-controller-manager and kube-scheduler"
    start_bg kube-controller-manager "$BIN_K8S/kube-controller-manager" \
        --kubeconfig="$W/controller-manager.kubeconfig" --leader-elect=false \
        --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
        --use-service-account-credentials=true --service-cluster-ip-range=$SERVICE_CIDR \
        --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
        --bind-address=127.0.0.1 --secure-port=10257 --feature-gates="$FEATURE_GATES" --v=1
    start_bg kube-scheduler "$BIN_K8S/kube-scheduler" \
        --kubeconfig="$W/scheduler.kubeconfig" --leader-elect=false \
        --bind-address=127.0.0.1 --secure-port=10259 --feature-gates="$FEATURE_GATES" --v=1

    # The pods reach the API server at the kubernetes Service's address, as in
    # any cluster; with no kube-proxy here, one DNAT rule plays its part.
    iptables -t nat -I PREROUTING -d "$SERVICE_IP/32" -p tcp --dport 443 \
        -j DNAT --to-destination "$HOST_IP:$APISERVER_PORT"
    iptables -t nat -I OUTPUT -d "$SERVICE_IP/32" -p tcp --dport 443 \
        -j DNAT --to-destination "$HOST_IP:$APISERVER_PORT"
    wait_for 60 "the default service account" kc -n default get serviceaccount default \
        || die "no default service account (logs/kube-controller-manager.log)"
}

apiserver_ready() { wait_for 120 kube-apiserver kc get --raw /readyz; }

# route_service NAMESPACE NAME: plays kube-proxy (there is none here) for one
# Service of one port: its cluster IP and port lead to its first ready
# endpoint, from pods and from the host.
route_service() {
    local ip port ep eport
    ip=$(kc -n "$1" get service "$2" -o jsonpath='{.spec.clusterIP}')
    port=$(kc -n "$1" get service "$2" -o jsonpath='{.spec.ports[0].port}')
    wait_for 120 "a ready endpoint of $1/$2" service_endpoint "$1" "$2" || return 1
    read -r ep eport <<<"$(service_endpoint "$1" "$2")"
    local chain
    for chain in PREROUTING OUTPUT; do
        iptables -t nat -I "$chain" -d "$ip/32" -p tcp --dport "$port" \
            -j DNAT --to-destination "$ep:$eport" || return 1
    done
}

# service_endpoint NAMESPACE NAME: "IP PORT" of a ready endpoint of a Service.
service_endpoint() {
    local out
    out=$(kc -n "$1" get endpointslices -l "kubernetes.io/service-name=$2" -o jsonpath='{range .items[*]}{range .endpoints[?(@.conditions.ready==true)]}{.addresses[0]}{" "}{end}{.ports[0].port}{"\n"}{end}' 2>/dev/null \
        | awk 'NF >= 2 {print $1, $NF; exit}')
    [ -n "$out" ] && echo "$out"
}

# start_node INDEX NAME [again]: a containerd and a kubelet for node NAME. The
# first node runs in the machine's mount namespace; another runs in a
# namespace of its own (node_namespace), where the paths deploy/ mounts are
# that node's own. "again" boots a node that ran before: its pools and
# containerd's images are there already.
start_node() {
    local i=$1 name=$2 again=${3:-}
    local cdir=$W/containerd-$name
    local in_ns=() cgroup_root=/
    if [ "$i" -gt 0 ]; then
        mountpoint -q "$W/node-$name/example-csi/pool" || mount_pools "$name-" "$W/node-$name/example-csi"
        node_namespace "$name"
        in_ns=(nsenter -t "$(cat "$W/node-$name/mntns.pid")" -m --)
        cgroup_root=/e2e-$name
        node_cgroups "$name"
    fi
    mkdir -p "$cdir" "$W/cni-$name/net.d" "$W/cni-$name/cache"
    cat >"$W/cni-$name/net.d/10-e2e.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "e2e-$name",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "e2e-br$i",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR_BASE.$i.0/24"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$W/cni-$name/ipam"
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
    # containerd 2's configuration (version 3); restrict_oom_score_adj because
    # this machine withholds CAP_SYS_RESOURCE.
    cat >"$cdir/config.toml" <<EOF
version = 3
root = "$cdir/root"
state = "$cdir/state"
[grpc]
  address = "$cdir/containerd.sock"
[ttrpc]
  address = "$cdir/containerd.sock.ttrpc"
[debug]
  level = "warn"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "$PAUSE_IMAGE"
[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  enable_cdi = false
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$W/cni-$name/net.d"
EOF
    log "starting containerd $CONTAINERD_VERSION for node $name"
    # its runc shim is found on PATH, next to it
    start_bg "containerd-$name" "${in_ns[@]}" env PATH="$BIN_CONTAINERD:$PATH" \
        "$BIN_CONTAINERD/containerd" --config "$cdir/config.toml"
    wait_for 60 "containerd of $name" ctr_ --address "$cdir/containerd.sock" version \
        || die "containerd did not start (logs/containerd-$name.log)"
    [ "$again" = again ] || import_images "$cdir/containerd.sock"

    local root=/var/lib/kubelet
    mkdir -p "$root"
    # Bidirectional mount propagation (the node plugin's mounts reaching the
    # pods) needs the kubelet's directory to be a shared mount (node_namespace
    # makes it so for the other nodes).
    if [ "$i" = 0 ] && ! awk -v p="$root" '$5 == p' /proc/self/mountinfo | grep -q shared:; then
        mount --bind "$root" "$root"
        mount --make-rshared "$root"
    fi
    local pki=$W/pki
    cat >"$W/kubelet-$name.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# the API server reaches each kubelet at its node's address (the machine's)
address: $HOST_IP
port: $((10250 + i * 10))
healthzBindAddress: 127.0.0.1
healthzPort: $((10248 + i * 10))
readOnlyPort: 0
cgroupDriver: cgroupfs
cgroupRoot: $cgroup_root
failCgroupV1: false
failSwapOn: false
tlsCertFile: $pki/kubelet-serving-$name.crt
tlsPrivateKeyFile: $pki/kubelet-serving-$name.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization:
  mode: Webhook
containerRuntimeEndpoint: unix://$cdir/containerd.sock
imageServiceEndpoint: unix://$cdir/containerd.sock
staticPodPath: ""
serializeImagePulls: false
# Images cannot be pulled again here: a disk shared with other work and low on
# room must not make the kubelet reclaim them (1 % of a large disk is GiBs).
# The kubelet's memory.available counts the page cache in active use as used:
# the scenarios' writes and transfers on a machine of little memory must not
# make it evict the test's pods, nor keep new ones away for the 5 minutes a
# MemoryPressure condition lasts by default (the kernel's OOM killer still
# answers a real shortage).
evictionHard: {memory.available: "16Mi", nodefs.available: "256Mi", imagefs.available: "256Mi", nodefs.inodesFree: "1%"}
evictionPressureTransitionPeriod: 10s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
resolvConf: /etc/resolv.conf
protectKernelDefaults: false
makeIPTablesUtilChains: true
localStorageCapacityIsolation: true
volumeStatsAggPeriod: 10s
# pods are looked at again every 10 s (not 1 min): a resized claim is grown
# in its running pod sooner
syncFrequency: 10s
featureGates: {CSIVolumeHealth: true}
maxPods: ${KUBELET_MAX_PODS:-110}
EOF
    log "starting kubelet $name (root $root)"
    start_bg "kubelet-$name" "${in_ns[@]}" "$BIN_K8S/kubelet" \
        --config="$W/kubelet-$name.yaml" --kubeconfig="$W/kubelet-$name.kubeconfig" \
        --hostname-override="$name" --node-ip="$HOST_IP" --root-dir="$root" \
        --cert-dir="$W/kubelet-$name-certs" --v=2
    wait_for 120 "node $name Ready" node_ready "$name" || die "node $name not Ready (logs/kubelet-$name.log)"
}

# second_node_up: the second node (NODES[1]), once: its kubelet joins and its
# pools join the ones the checks look at.
second_node_up() {
    local second=${NODES[1]}
    kc get node "$second" >/dev/null 2>&1 && return 0
    start_node 1 "$second"
    POOL_DIRS+=("$W/node-$second/example-csi/pool" "$W/node-$second/example-csi/ssd")
}

# mount_pools PREFIX DIR: the two pools the manifests name (pool, ssd), each an
# xfs with reflink on a sparse image $W/pools/PREFIX<name>.img, mounted at DIR/<name>.
mount_pools() {
    local p
    for p in pool ssd; do
        truncate -s 64G "$W/pools/$1$p.img"
        mkfs.xfs -q -f -m reflink=1 "$W/pools/$1$p.img"
    done
    mount_pool_images "$@"
}

# mount_pool_images PREFIX DIR: the pools' images made by mount_pools mounted
# (again, as at boot).
mount_pool_images() {
    local p
    for p in pool ssd; do
        mkdir -p "$2/$p"
        mount -o loop "$W/pools/$1$p.img" "$2/$p" || return 1
    done
}

# node_namespace NAME: the mount namespace of a second node on this machine.
# deploy/ mounts /var/lib/kubelet and /var/lib/example-csi on every node; here
# they (and the kubelet's pod logs, which a kubelet prunes of pods it does not
# know) are the node's own directories under $W/node-NAME, with pools of its
# own (xfs images in $W/pools, mounted on the host at $W/node-NAME/example-csi
# by start_node, so that the checks see them). The namespace is held by a
# process recorded for teardown; its containerd and kubelet enter it. When
# every process in it is gone, every mount made in it goes too (a reboot).
node_namespace() {
    local name=$1 dir=$W/node-$1
    mkdir -p "$dir/kubelet" "$dir/example-csi" "$dir/log-pods" "$dir/log-containers"
    start_bg "mntns-$name" unshare --mount --propagation private sleep infinity
    local pid; pid=$(pid_of "mntns-$name")
    wait_for 10 "the mount namespace of $name" not_my_mntns "$pid" || die "no mount namespace for $name"
    # What the namespace inherited of the first node (its kubelet's and
    # containerd's mounts, its pools, the volumes staged there) goes first: a
    # copy here would keep those filesystems mounted after the first node
    # unmounts them, and a mount stacked on them would not be the one
    # containerd finds for the paths.
    nsenter -t "$pid" -m -- sh -ec "
        awk '{print \$5}' /proc/self/mountinfo \
            | grep -E '^(/var/lib/kubelet|/var/lib/example-csi|/run/containerd|/run/netns|$W/containerd-)(/|\$)' \
            | sort -r | while read -r m; do umount -l \"\$m\" 2>/dev/null || true; done
        mount --bind '$dir/kubelet' /var/lib/kubelet
        mount --make-rshared /var/lib/kubelet
        mount --rbind '$dir/example-csi' /var/lib/example-csi
        mount --make-rshared /var/lib/example-csi
        mkdir -p /var/log/pods /var/log/containers
        mount --bind '$dir/log-pods' /var/log/pods
        mount --bind '$dir/log-containers' /var/log/containers" || die "cannot set up the mounts of $name"
    echo "$pid" >"$dir/mntns.pid"
}

not_my_mntns() { [ "$(readlink "/proc/$1/ns/mnt")" != "$(readlink /proc/self/ns/mnt)" ]; }

# node_cgroups NAME: the cgroup the node's kubelet puts its pods under, in
# every hierarchy (cgroup v1), so that two kubelets do not share kubepods.
node_cgroups() {
    local h
    for h in /sys/fs/cgroup/*/; do
        [ -L "${h%/}" ] && continue
        mkdir -p "$h/e2e-$1"
        if [ -f "$h/cpuset.cpus" ]; then
            cat "$h/cpuset.cpus" >"$h/e2e-$1/cpuset.cpus"
            cat "$h/cpuset.mems" >"$h/e2e-$1/cpuset.mems"
        fi
    done
}

node_ready() {
    [ "$(kc get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

# stop_cluster: every pod's containers, then the kubelets, containerds, control
# plane and etcd, by the PIDs recorded at start.
stop_cluster() {
    [ -f "$W/pids" ] || return 0
    # the kubelets first, so that nothing restarts what is being stopped
    stop_pids kubelet
    for sock in "$W"/containerd-*/containerd.sock; do
        [ -S "$sock" ] || continue
        local t
        for t in $(ctr_ --address "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
            ctr_ --address "$sock" -n k8s.io tasks kill -s KILL "$t" >/dev/null 2>&1 || true
        done
        sleep 1
        for t in $(ctr_ --address "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
            ctr_ --address "$sock" -n k8s.io tasks delete -f "$t" >/dev/null 2>&1 || true
        done
    done
    stop_pids containerd
    # shims outlive containerd: end them and what they run
    local pid
    for pid in $(pgrep -f "containerd-shim.*-address $W/" 2>/dev/null); do
        pkill -KILL -P "$pid" 2>/dev/null || true
        kill -KILL "$pid" 2>/dev/null || true
    done
    stop_pids kube-scheduler
    stop_pids kube-controller-manager
    stop_pids kube-apiserver
    stop_pids etcd
    stop_pids ""
}

# stop_pids PREFIX: TERM, then KILL after 10 s, the recorded processes whose
# name starts with PREFIX (all of them for "").
stop_pids() {
    local prefix=$1 pid name pids=()
    while read -r pid name; do
        [[ $name == "$prefix"* ]] && kill -0 "$pid" 2>/dev/null && pids+=("$pid")
    done <"$W/pids"
    [ ${#pids[@]} -eq 0 ] && return 0
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; done
    local end=$((SECONDS + 10))
    for pid in "${pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 0.2; done
        kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    done
}
