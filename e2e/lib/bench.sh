# shellcheck shell=bash
# The cluster benchmark (e2e/run.sh --bench OUT): this driver, deployed as
# deploy/ ships the flavor, and the reference driver (csi-driver-host-path's
# hostpathplugin with the same sidecars, e2e/manifests/reference-hostpath.yaml)
# side by side on the same nodes (two kubelets for the flavors of more than
# one node, unless --single-node), each on an xfs of its own on every node;
# then e2e/lib/bench_cluster.py measures claim-to-Running and where its time
# goes, bursts on one node and spread over both, snapshots and restores
# through the Kubernetes API for both, round after round in alternating
# order, and writes OUT/results.{md,json} and OUT/machine.txt.
#
# Needs: E2E_DIR, E2E_CACHE, W, NODE, NODES, NS, POOL_ROOT, HOST_IP, kc, log,
# die, fail, pool_dir, nodes_up, second_node_up.

HOSTPATH_IMAGE=example-csi-e2e/hostpathplugin:$HOSTPATH_VERSION

# reference_data [NODE]: the reference driver's data directory on NODE (the
# first node's by default), as the host sees it. Every node's plugin finds
# its own at $POOL_ROOT/reference, in that node's mount namespace.
reference_data() { pool_dir "${1:-$NODE}" reference; }

# bench_images: the reference driver's image (the driver's Debian root
# filesystem, which holds the mount, tar and losetup it runs, and its binary).
bench_images() {
    local dir=$W/images
    rm -rf "$dir/hostpath"; mkdir -p "$dir/hostpath"
    install -m 0755 "$E2E_CACHE/hostpath-$HOSTPATH_VERSION/hostpathplugin" "$dir/hostpath/hostpathplugin"
    python3 "$E2E_ROOT/e2e/lib/mkimage.py" "$dir/hostpath.tar" "$HOSTPATH_IMAGE" \
        --layer "$(driver_rootfs)" --layer "$dir/hostpath" --entrypoint '["/hostpathplugin"]'
}

# bench_pool: the reference driver's data directory on each node, an xfs
# with reflink on a sparse image like each of this driver's pools (torn down
# with them). Made before the second node starts: its mount namespace takes
# the directory with the rest of $W/node-NAME/example-csi (node_namespace),
# as it takes that node's own pools.
bench_pool() {
    local n img
    for n in "${NODES[@]}"; do
        img=$W/pools/reference.img
        [ "$n" = "${NODES[0]}" ] || img=$W/pools/$n-reference.img
        truncate -s 64G "$img"
        mkfs.xfs -q -f -m reflink=1 "$img"
        mkdir -p "$(reference_data "$n")"
        mount -o loop "$img" "$(reference_data "$n")"
    done
}

# reference_registered NODE: the kubelet of NODE lists the reference driver.
reference_registered() {
    kc get csinode "$1" -o jsonpath='{.spec.drivers[*].name}' 2>/dev/null | grep -qw hostpath.csi.k8s.io
}

bench_deploy_reference() {
    sed -e "s|PROVISIONER_TAG|$PROVISIONER_VERSION|; s|SNAPSHOTTER_TAG|$SNAPSHOTTER_VERSION|" \
        -e "s|REGISTRAR_TAG|$REGISTRAR_VERSION|; s|HOSTPATH_IMAGE|$HOSTPATH_IMAGE|" \
        -e "s|path: DATA_DIR|path: $POOL_ROOT/reference|" \
        "$E2E_DIR/manifests/reference-hostpath.yaml" | kc apply -f - >"$W/logs/apply-reference.log" 2>&1 \
        || die "cannot apply the reference driver (logs/apply-reference.log)"
    kc -n reference-hostpath rollout status daemonset/reference-hostpath --timeout=180s >/dev/null \
        || die "the reference driver is not ready"
    local n
    for n in $(nodes_up); do
        wait_for 60 "the kubelet of $n registered the reference driver" reference_registered "$n" \
            || die "the reference driver did not register on $n"
    done
}

# bench_classes: this driver's classes for the benchmark, one a filesystem,
# in the default pool (an xfs like the reference's), and one of directory
# volumes, the reference's own kind (a bind mount, no filesystem to mount).
bench_classes() {
    local name params
    for name in ext4 xfs dir; do
        case $name in
            dir) params="kind: dir" ;;
            *) params="csi.storage.k8s.io/fstype: $name" ;;
        esac
        kc apply -f - >/dev/null <<EOF
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: bench-$name}
provisioner: example.csi.k8s.io
parameters: {type: default, $params}
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
EOF
    done
    kc apply -f "$E2E_ROOT/deploy/examples/volumesnapshotclass.yaml" >/dev/null
}

# bench_config FILE: what bench_cluster.py reads: the rows of one node run
# their pods on the first node, burst2n on every node up.
bench_config() {
    local ours='"csi_driver": "example.csi.k8s.io", "pods_namespace": "'$DRIVER_NS'",
      "pods_selector": "app.kubernetes.io/name=example-csi",
      "metrics_selector": "app.kubernetes.io/name=example-csi",
      "driver_containers": ["csi-driver"], "metrics_port": 9810, "snapshot_class": "example-csi"'
    local joined
    joined=$(nodes_up | sed 's/.*/"&"/' | paste -sd, -)
    cat >"$1" <<EOF
{"server": "https://$HOST_IP:$APISERVER_PORT", "ca": "$W/pki/ca.crt",
 "cert": "$W/pki/admin.crt", "key": "$W/pki/admin.key",
 "namespace": "$NS", "node": "$NODE", "nodes": [$joined], "image": "$BUSYBOX_IMAGE",
 "drivers": [
  {"name": "example-csi ext4", "class": "bench-ext4", $ours},
  {"name": "example-csi xfs", "class": "bench-xfs", $ours},
  {"name": "example-csi dir", "class": "bench-dir", $ours},
  {"name": "hostpath $HOSTPATH_VERSION", "csi_driver": "hostpath.csi.k8s.io",
   "class": "bench-reference", "snapshot_class": "bench-reference",
   "pods_namespace": "reference-hostpath", "pods_selector": "app.kubernetes.io/name=reference-hostpath",
   "driver_containers": ["hostpath"]}
 ]}
EOF
}

bench_machine() {
    {
        echo "date: $(date -u '+%F %T UTC')"
        echo "commit: $(git -C "$E2E_ROOT" rev-parse --short HEAD 2>/dev/null)$(git -C "$E2E_ROOT" diff --quiet 2>/dev/null || echo ' (with changes)')"
        echo "kernel: $(uname -r); cpus: $(nproc); memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
        echo "Kubernetes $KUBERNETES_VERSION; flavor $1; sidecars: provisioner $PROVISIONER_VERSION, snapshotter $SNAPSHOTTER_VERSION, registrar $REGISTRAR_VERSION"
        echo "nodes: $(nodes_up | paste -sd' ' -) (kubelets on this one machine; the rows of one node on $NODE)"
        echo "reference: csi-driver-host-path $HOSTPATH_VERSION (hostpathplugin) on every node, data on xfs (reflink) like the pools"
        echo "stress: ${BENCH_STRESS:-none}"
        echo "command: $BENCH_COMMAND"
    } >"$BENCH_OUT/machine.txt"
}

# bench_flavor FLAVOR: deploy, measure, remove.
bench_flavor() {
    local flavor=$1
    # shellcheck disable=SC2034 # read by the checks deploy_flavor runs
    FLAVOR=$flavor CONTROLLER_COMPONENT=controller
    # shellcheck disable=SC2034
    [ "$flavor" = distributed ] && CONTROLLER_COMPONENT=node
    # every node up before the flavor is deployed, as the cluster flavor's
    # scenarios have it: its router reaches a node agent on each
    if [ ${#NODES[@]} -gt 1 ]; then second_node_up; fi
    set +e
    deploy_flavor "$flavor" || { undeploy_flavor "$flavor"; set -e; die "cannot deploy $flavor"; }
    set -e
    bench_deploy_reference
    kc create namespace "$NS" >/dev/null
    bench_classes
    mkdir -p "$BENCH_OUT"
    bench_config "$W/bench.json"
    bench_machine "$flavor"
    local stress_pid=""
    if [ -n "${BENCH_STRESS:-}" ]; then
        # shellcheck disable=SC2086
        setsid stress-ng $BENCH_STRESS >"$W/logs/stress.log" 2>&1 &
        stress_pid=$!
        echo "$stress_pid stress-ng" >>"$W/pids"
    fi
    local rc=0
    python3 "$E2E_DIR/lib/bench_cluster.py" --config "$W/bench.json" --out "$BENCH_OUT" "${BENCH_ARGS[@]}" || rc=$?
    [ -n "$stress_pid" ] && kill -- -"$stress_pid" 2>/dev/null
    [ "$rc" = 0 ] || fail "the benchmark ended with $rc (its report holds what it measured)"
    set +e
    kc delete namespace "$NS" --wait=true --timeout=300s >/dev/null 2>&1
    kc delete -f "$E2E_DIR/manifests/reference-hostpath.yaml" --wait=true --timeout=180s >/dev/null 2>&1
    undeploy_flavor "$flavor"
    set -e
}
