# shellcheck shell=bash
# Upgrade and rollback with volumes in use. The release before this build
# (PREVIOUS_RELEASE, its binary and deploy/ built from its commit by
# previous_release) is installed as its deploy/ ships it; workloads write on
# claims of either node and a snapshot is taken; then this build is applied
# over it, which Kubernetes rolls out (the Deployment's pod replaced, the
# DaemonSet's pods one node at a time); then `kubectl rollout undo` takes
# both workloads back to the release before; then this build is applied
# again. After each step the running workloads read what they wrote, in the
# same containers (through all three rollouts), and the version then running
# works on what the other made (restores, expansion, snapshots, deletion)
# and makes new volumes.
#
# Needs: PREVIOUS_DIR (or PREVIOUS_WHY), FLAVOR, NODES, DRIVER_NS, and what
# scenarios.sh and scenarios_chaos.sh define.

scenario_upgrade() {
    scenario "v$PREVIOUS_RELEASE installed, upgraded to v$(driver_version), rolled back and forward with volumes in use"
    if [ -z "$PREVIOUS_DIR" ]; then
        echo "  NOT RUN  ${PREVIOUS_WHY:-the previous release was not built}"
        return
    fi
    local first=${NODES[0]} second=${NODES[${#NODES[@]}-1]}
    local now; now=$(driver_version)

    render "$FLAVOR" "$PREVIOUS_DIR/deploy" "previous-$FLAVOR"
    local missing; missing=$(images_not_built "$W/deploy-previous-$FLAVOR.yaml")
    check_eq "every image v$PREVIOUS_RELEASE's manifests name is one this run built" "" "$missing"
    [ -z "$missing" ] || return
    apply_manifests "$W/deploy-previous-$FLAVOR.yaml" previous
    rolled_out_on "$PREVIOUS_RELEASE" || return
    kc get namespace "$NS" >/dev/null 2>&1 || kc create namespace "$NS" >/dev/null
    storage_classes
    local before; before=$(pool_files)

    # what the release before makes and serves
    pvc up-fs 1Gi example-csi
    pvc up-xfs 1Gi e2e-xfs
    pvc up-raw 256Mi example-csi-block Block
    pod up-fs up-fs "$WRITE_ONCE" "$(on_node "$first")"
    pod up-xfs up-xfs "$WRITE_ONCE" "$(on_node "$second")"
    app_pod up-raw up-raw "$BLOCK_WRITE_ONCE" "volumeDevices: [{name: data, devicePath: /dev/xvda}]" \
        "$(on_node "$second")"
    eventually 180 "v$PREVIOUS_RELEASE serves an ext4, an xfs and a raw block claim, on $first and $second" \
        all_of "pod_running up-fs" "pod_running up-xfs" "pod_running up-raw" || return
    eventually 60 "the workloads wrote their data" all_of "in_pod up-fs test -s /data/file.sum" \
        "in_pod up-xfs test -s /data/file.sum" "in_pod up-raw test -e /tmp/written" || return
    local fs_sum xfs_sum raw_sum containers
    fs_sum=$(in_pod up-fs cat /data/file.sum)
    xfs_sum=$(in_pod up-xfs cat /data/file.sum)
    raw_sum=$(raw_sum_of up-raw)
    containers=$(container_ids up-fs up-xfs up-raw)
    take_snapshot up-snap-fs up-fs || return

    # upgrade
    log "upgrading to v$now"
    render "$FLAVOR"
    apply_manifests "$W/deploy-$FLAVOR.yaml" "v$now"
    rolled_out_on "$now" || return
    workloads_unharmed "v$now" "$containers" "$fs_sum" "$xfs_sum" "$raw_sum"
    restored_reads up-restored 1Gi example-csi up-snap-fs "$second" "$fs_sum" \
        "v$now restores v$PREVIOUS_RELEASE's snapshot (on the other node)"
    kc -n "$NS" patch pvc up-xfs --type merge -p '{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}' >/dev/null
    eventually 120 "v$now grows v$PREVIOUS_RELEASE's xfs claim in use to 2Gi" \
        field_is pvc/up-xfs '{.status.capacity.storage}' 2Gi
    eventually 60 "its pod sees the larger filesystem" df_over up-xfs /data $((1536 << 10))
    take_snapshot up-snap-xfs up-xfs
    pvc up-new 1Gi example-csi
    pod up-new up-new "$WRITE_ONCE" "$(on_node "$first")"
    eventually 180 "v$now provisions, stages and publishes a new claim" pod_running up-new

    # rollback
    log "rolling back to v$PREVIOUS_RELEASE"
    local w
    for w in $(driver_workloads); do
        kc -n "$DRIVER_NS" rollout undo "$w" >>"$W/logs/rollout-undo.log" 2>&1 \
            || fail "kubectl rollout undo $w (logs/rollout-undo.log)"
    done
    rolled_out_on "$PREVIOUS_RELEASE" || return
    workloads_unharmed "v$PREVIOUS_RELEASE" "$containers" "$fs_sum" "$xfs_sum" "$raw_sum"
    check_sum "v$PREVIOUS_RELEASE serves the claim v$now restored" "$fs_sum" \
        "$(in_pod up-restored sha256sum /data/file | cut -c1-64)"
    restored_reads up-back 2Gi e2e-xfs up-snap-xfs "$first" "$xfs_sum" \
        "v$PREVIOUS_RELEASE restores the snapshot v$now took (on the other node)"
    local new_image; new_image=$(pool_file_of "$(volume_of up-new)")
    delete_pod up-new
    kc -n "$NS" delete pvc up-new --wait=true --timeout=120s >/dev/null
    eventually 60 "v$PREVIOUS_RELEASE unstages and deletes the volume v$now made" not test -e "$new_image"

    # forward again, as the scenarios after this one find it
    log "upgrading to v$now again"
    apply_manifests "$W/deploy-$FLAVOR.yaml" "v$now"
    rolled_out_on "$now" || return
    workloads_unharmed "v$now" "$containers" "$fs_sum" "$xfs_sum" "$raw_sum"

    delete_pod up-fs up-xfs up-raw up-restored up-back
    kc -n "$NS" delete volumesnapshot up-snap-fs up-snap-xfs --wait=true --timeout=120s >/dev/null
    kc -n "$NS" delete pvc up-fs up-xfs up-raw up-restored up-back --wait=true --timeout=180s >/dev/null
    eventually 120 "deleting it all leaves the pools as they were" same_list "$before" pool_files \
        || pool_files | sed 's/^/        /'
}

# restored_reads NAME SIZE CLASS SNAPSHOT NODE SUM WHAT: a claim NAME
# restored from SNAPSHOT for a pod pinned to NODE, which reads the data of
# checksum SUM.
restored_reads() {
    pvc "$1" "$2" "$3" Filesystem \
        "  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: $4}"
    pod "$1" "$1" "$READ_DATA" "$(on_node "$5")"
    eventually 180 "$7" pod_running "$1" || return
    eventually 30 "its pod read the data" in_pod "$1" test -s /tmp/now.sum
    check_sum "and sees what the snapshot's source held" "$6" "$(in_pod "$1" cat /tmp/now.sum)"
}

# images_not_built FILE: the images the manifests of FILE name that the
# first node's containerd does not hold, one a line.
images_not_built() {
    local have image
    have=$(ctr_ --address "$W/containerd-${NODES[0]}/containerd.sock" -n k8s.io images ls -q)
    for image in $(sed -n 's/^ *image: *//p' "$1" | tr -d '"' | sort -u); do
        grep -qxF "$(full_image_name "$image")" <<<"$have" || echo "$image"
    done
}

# full_image_name IMAGE: the name containerd keeps IMAGE under (a name
# without a registry is Docker Hub's, one without a namespace its library's).
full_image_name() {
    local first=${1%%/*}
    if [[ $1 != */* ]]; then echo "docker.io/library/$1"
    elif [[ $first != *.* && $first != *:* && $first != localhost ]]; then echo "docker.io/$1"
    else echo "$1"; fi
}

# apply_manifests FILE WHAT: kubectl apply, and once more when the first
# apply meets a custom resource before its definition (as deploy_flavor).
apply_manifests() {
    local log=$W/logs/apply-$2.log
    if ! kc apply -f "$1" >"$log" 2>&1; then
        kc wait --for=condition=Established crd -l app.kubernetes.io/part-of=example-csi --timeout=60s >/dev/null || true
        local rc=0
        kc apply -f "$1" >>"$log" 2>&1 || rc=$?
        check_eq "kubectl apply of $2 (logs/apply-$2.log)" 0 "$rc"
    fi
}

# driver_workloads: the Deployments and DaemonSets of the driver's namespace.
driver_workloads() {
    kc -n "$DRIVER_NS" get deployment,daemonset -o name
}

# rolled_out_on VERSION: every workload of the driver rolled out, each pod
# of it ready on image VERSION of the driver, and the kubelet of every node
# registered with it.
rolled_out_on() {
    local w n
    for w in $(driver_workloads); do
        eventually 300 "$w rolled out" kc -n "$DRIVER_NS" rollout status "$w" --timeout=5s || return 1
    done
    eventually 120 "every driver container runs example-csi/csi-driver:v$1, ready" driver_pods_on "$1" \
        || { kc -n "$DRIVER_NS" get pod -o wide | sed 's/^/        /'; return 1; }
    for n in $(nodes_up); do
        eventually 120 "the kubelet of $n has the driver registered" csinode_has_driver "$n" || return 1
    done
}

# driver_pods_on VERSION: each pod of the driver's namespace that runs the
# driver runs it from image VERSION, ready, and no other pod is left
# (none terminating).
driver_pods_on() {
    local pods
    pods=$(kc -n "$DRIVER_NS" get pod -o json | python3 -c '
import json, sys
want = "example-csi/csi-driver:v" + sys.argv[1]
for p in json.load(sys.stdin)["items"]:
    if p["metadata"].get("deletionTimestamp"):
        print("terminating", p["metadata"]["name"]); continue
    images = {c["image"] for c in p["spec"]["containers"] if c["image"].startswith("example-csi/csi-driver:")}
    ready = all(s.get("ready") for s in p.get("status", {}).get("containerStatuses", []) or [{}])
    if images and (images != {want} or not ready):
        print("not yet", p["metadata"]["name"])
    elif images:
        print("ok", p["metadata"]["name"])' "$1")
    grep -q '^ok' <<<"$pods" && ! grep -qv '^ok' <<<"$pods"
}

# container_ids POD...: the container id of each POD, one line.
container_ids() {
    local p
    for p in "$@"; do jp "pod/$p" '{.status.containerStatuses[0].containerID} '; done
}

# raw_sum_of POD: the checksum of the first 4 MiB of POD's raw block device.
raw_sum_of() {
    in_pod "$1" sh -c 'dd if=/dev/xvda bs=1M count=4 2>/dev/null | sha256sum | cut -c1-64'
}

# workloads_unharmed WHAT CONTAINERS FS XFS RAW: the three workloads ran on
# through the rollout of WHAT in the same CONTAINERS, read their data (sums
# FS, XFS, RAW) and write more; each volume is staged once.
workloads_unharmed() {
    check_eq "the workloads ran on through the rollout of $1, in the same containers" "$2" \
        "$(container_ids up-fs up-xfs up-raw)"
    check_sum "the ext4 claim's pod reads its data under $1" "$3" "$(in_pod up-fs sha256sum /data/file | cut -c1-64)"
    check_sum "the xfs claim's pod reads its data under $1" "$4" "$(in_pod up-xfs sha256sum /data/file | cut -c1-64)"
    check_sum "the raw block pod reads its device under $1" "$5" "$(raw_sum_of up-raw)"
    check "and each writes on (a file written and synced)" all_of \
        "in_pod up-fs sh -c 'echo $1 >> /data/log && sync'" "in_pod up-xfs sh -c 'echo $1 >> /data/log && sync'"
    local c images=()
    for c in up-fs up-xfs up-raw; do images+=("$(pool_file_of "$(volume_of "$c")")"); done
    check_eq "each volume staged once: one loop device on each image" "1 1 1" \
        "$(for c in "${images[@]}"; do loops_of "$c" | grep -c .; done | paste -sd' ')"
}

# From the distributed flavor (a provisioner, snapshotter and resizer on each
# node) to the cluster flavor (one controller reaching the nodes' agents)
# with volumes in use, as deploy/README.md tells an operator to switch: the
# cluster flavor applied over the distributed one, then what only the
# distributed flavor had deleted. The claims and snapshots the distributed
# flavor made (handles without a node) keep working through the router:
# their pods run on in the same containers and read their data, a new pod
# stages a claim again, an xfs claim in use grows, a snapshot of it is taken,
# the old snapshot is restored on the other node, and everything is deleted
# without a trace. The cluster flavor is removed at the end, so that the
# scenarios after this one start from nothing.
scenario_from_distributed() {
    scenario "the distributed flavor switched to the cluster flavor with volumes in use"
    local first=${NODES[0]} second=${NODES[${#NODES[@]}-1]}
    local now; now=$(driver_version)
    render distributed
    apply_manifests "$W/deploy-distributed.yaml" distributed
    rolled_out_on "$now" || return
    kc get namespace "$NS" >/dev/null 2>&1 || kc create namespace "$NS" >/dev/null
    storage_classes
    local before; before=$(pool_files)

    pvc mig-fs 1Gi example-csi
    pvc mig-xfs 1Gi e2e-xfs
    pod mig-fs mig-fs "$WRITE_ONCE" "$(on_node "$first")"
    pod mig-xfs mig-xfs "$WRITE_ONCE" "$(on_node "$second")"
    eventually 180 "the distributed flavor serves an ext4 claim on $first and an xfs claim on $second" \
        all_of "pod_running mig-fs" "pod_running mig-xfs" || return
    eventually 60 "the workloads wrote their data" \
        all_of "in_pod mig-fs test -s /data/file.sum" "in_pod mig-xfs test -s /data/file.sum" || return
    local fs_sum xfs_sum containers
    fs_sum=$(in_pod mig-fs cat /data/file.sum)
    xfs_sum=$(in_pod mig-xfs cat /data/file.sum)
    containers=$(container_ids mig-fs mig-xfs)
    take_snapshot mig-snap-fs mig-fs || return
    check "the volume handles name no node (made without the router)" \
        not grep -q @ <<<"$(kc get pv -o jsonpath='{.items[*].spec.csi.volumeHandle}')"

    log "switching to the cluster flavor"
    render cluster
    apply_manifests "$W/deploy-cluster.yaml" cluster
    local gone
    gone=$(objects_only_in "$W/deploy-distributed.yaml" "$W/deploy-cluster.yaml")
    check "the distributed flavor has objects the cluster flavor has not (its resizer among them)" \
        grep -q 'deployment.apps/example-csi-resizer' <<<"$gone"
    # shellcheck disable=SC2086
    kc -n "$DRIVER_NS" delete $gone --wait=true --timeout=120s >"$W/logs/switch-delete.log" 2>&1 \
        || fail "deleting what only the distributed flavor had (logs/switch-delete.log)"
    rolled_out_on "$now" || return
    check "no resizer left" count_is 0 kc -n "$DRIVER_NS" get deployment example-csi-resizer -o name --ignore-not-found

    check_eq "the workloads ran on through the switch, in the same containers" "$containers" \
        "$(container_ids mig-fs mig-xfs)"
    check_sum "the ext4 claim's pod reads its data" "$fs_sum" "$(in_pod mig-fs sha256sum /data/file | cut -c1-64)"
    check_sum "the xfs claim's pod reads its data" "$xfs_sum" "$(in_pod mig-xfs sha256sum /data/file | cut -c1-64)"
    restored_reads mig-restored 1Gi example-csi mig-snap-fs "$second" "$fs_sum" \
        "the cluster flavor restores the distributed flavor's snapshot on the other node"
    kc -n "$NS" patch pvc mig-xfs --type merge -p '{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}' >/dev/null
    eventually 120 "the cluster flavor grows the distributed flavor's xfs claim in use to 2Gi" \
        field_is pvc/mig-xfs '{.status.capacity.storage}' 2Gi
    eventually 60 "its pod sees the larger filesystem" df_over mig-xfs /data $((1536 << 10))
    take_snapshot mig-snap-xfs mig-xfs
    delete_pod mig-fs
    pod mig-fs mig-fs "$READ_DATA" "$(on_node "$first")"
    eventually 180 "a new pod of the ext4 claim starts (staged again by the cluster flavor)" pod_running mig-fs
    eventually 30 "and reads the data" in_pod mig-fs test -s /tmp/now.sum
    check_sum "the data the distributed flavor's pod wrote" "$fs_sum" "$(in_pod mig-fs cat /tmp/now.sum)"

    delete_pod mig-fs mig-xfs mig-restored
    kc -n "$NS" delete volumesnapshot mig-snap-fs mig-snap-xfs --wait=true --timeout=120s >/dev/null
    kc -n "$NS" delete pvc mig-fs mig-xfs mig-restored --wait=true --timeout=180s >/dev/null
    eventually 120 "no PersistentVolume or VolumeSnapshotContent left" all_of \
        "count_is 0 kc get pv -o name" "count_is 0 kc get volumesnapshotcontent -o name"
    eventually 120 "deleting it all leaves the pools as they were" same_list "$before" pool_files \
        || pool_files | sed 's/^/        /'
    kc delete -f "$W/deploy-cluster.yaml" --wait=true --timeout=180s >/dev/null 2>&1 || true
    eventually 120 "the driver's pods gone before the next scenario" count_is 0 kc -n "$DRIVER_NS" get pods -o name
}

# objects_only_in OLD NEW: the objects (kind.group/name) of the manifests in
# file OLD that file NEW has not, one a line.
objects_only_in() {
    comm -23 <(kc create --dry-run=client -o name -f "$1" | sort) \
        <(kc create --dry-run=client -o name -f "$2" | sort)
}
