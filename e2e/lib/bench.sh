# shellcheck shell=bash
# The cluster benchmark (e2e/run.sh --bench OUT): this driver, deployed as
# deploy/ ships the flavor, and the reference driver (csi-driver-host-path's
# hostpathplugin with the same sidecars, e2e/manifests/reference-hostpath.yaml)
# side by side on the same node, each on an xfs of its own; then
# e2e/lib/bench_cluster.py measures claim-to-Running, bursts, snapshots and
# restores through the Kubernetes API for both, round after round in
# alternating order, and writes OUT/results.{md,json} and OUT/machine.txt.
#
# Needs: E2E_DIR, E2E_CACHE, W, NODE, NS, POOL_ROOT, BIN_K8S, kc, log, die.

HOSTPATH_IMAGE=example-csi-e2e/hostpathplugin:$HOSTPATH_VERSION

# reference_data: the reference driver's data directory.
reference_data() { echo "$POOL_ROOT/reference"; }

# bench_images: the reference driver's image (the driver's Debian root
# filesystem, which holds the mount, tar and losetup it runs, and its binary).
bench_images() {
    local dir=$W/images
    rm -rf "$dir/hostpath"; mkdir -p "$dir/hostpath"
    install -m 0755 "$E2E_CACHE/hostpath-$HOSTPATH_VERSION/hostpathplugin" "$dir/hostpath/hostpathplugin"
    python3 "$E2E_ROOT/e2e/lib/mkimage.py" "$dir/hostpath.tar" "$HOSTPATH_IMAGE" \
        --layer "$(driver_rootfs)" --layer "$dir/hostpath" --entrypoint '["/hostpathplugin"]'
}

# bench_pool: the reference driver's data directory, an xfs with reflink on a
# sparse image like each of this driver's pools (torn down with them).
bench_pool() {
    truncate -s 64G "$W/pools/reference.img"
    mkfs.xfs -q -f -m reflink=1 "$W/pools/reference.img"
    mkdir -p "$(reference_data)"
    mount -o loop "$W/pools/reference.img" "$(reference_data)"
}

bench_deploy_reference() {
    sed -e "s|PROVISIONER_TAG|$PROVISIONER_VERSION|; s|SNAPSHOTTER_TAG|$SNAPSHOTTER_VERSION|" \
        -e "s|REGISTRAR_TAG|$REGISTRAR_VERSION|; s|HOSTPATH_IMAGE|$HOSTPATH_IMAGE|" \
        -e "s|hostname: NODE|hostname: $NODE|; s|path: DATA_DIR|path: $(reference_data)|" \
        "$E2E_DIR/manifests/reference-hostpath.yaml" | kc apply -f - >"$W/logs/apply-reference.log" 2>&1 \
        || die "cannot apply the reference driver (logs/apply-reference.log)"
    kc -n reference-hostpath rollout status daemonset/reference-hostpath --timeout=180s >/dev/null \
        || die "the reference driver is not ready"
    wait_for 60 "the kubelet registered the reference driver" \
        sh -c "'$BIN_K8S/kubectl' --kubeconfig '$W/admin.kubeconfig' get csinode '$NODE' -o jsonpath='{.spec.drivers[*].name}' | grep -qw hostpath.csi.k8s.io" \
        || die "the reference driver did not register"
}

# bench_classes: this driver's classes for the benchmark, one a filesystem,
# in the default pool (an xfs like the reference's).
bench_classes() {
    local fs
    for fs in ext4 xfs; do
        kc apply -f - >/dev/null <<EOF
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: bench-$fs}
provisioner: example.csi.k8s.io
parameters: {type: default, csi.storage.k8s.io/fstype: $fs}
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
EOF
    done
    kc apply -f "$E2E_ROOT/deploy/examples/volumesnapshotclass.yaml" >/dev/null
}

# bench_config FILE: what bench_cluster.py reads.
bench_config() {
    local ours='"pods_namespace": "'$DRIVER_NS'", "pods_selector": "app.kubernetes.io/name=example-csi",
      "metrics_selector": "app.kubernetes.io/name=example-csi",
      "driver_containers": ["csi-driver"], "metrics_port": 9810, "snapshot_class": "example-csi"'
    cat >"$1" <<EOF
{"server": "https://$HOST_IP:$APISERVER_PORT", "ca": "$W/pki/ca.crt",
 "cert": "$W/pki/admin.crt", "key": "$W/pki/admin.key",
 "namespace": "$NS", "node": "$NODE", "image": "$BUSYBOX_IMAGE",
 "drivers": [
  {"name": "example-csi ext4", "class": "bench-ext4", $ours},
  {"name": "example-csi xfs", "class": "bench-xfs", $ours},
  {"name": "hostpath $HOSTPATH_VERSION", "class": "bench-reference", "snapshot_class": "bench-reference",
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
        echo "reference: csi-driver-host-path $HOSTPATH_VERSION (hostpathplugin), data on xfs (reflink) like the pools"
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
    sed "s|hostname: NODE|hostname: $NODE|" "$E2E_DIR/manifests/reference-hostpath.yaml" \
        | kc delete -f - --wait=true --timeout=180s >/dev/null 2>&1
    undeploy_flavor "$flavor"
    set -e
}
