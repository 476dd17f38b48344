# shellcheck shell=bash
# The end-to-end scenarios. Each one acts as a user would (StorageClasses,
# claims, pods, snapshots through the Kubernetes API only) and then checks the
# objects, what the pod sees, and what the pool holds.
#
# Needs: kc, NS, NODES, POOL_DIRS, BUSYBOX_IMAGE, FLAVOR.

WRITE_DATA='dd if=/dev/urandom of=/data/file bs=1M count=16 2>/dev/null && sha256sum /data/file | cut -c1-64 > /data/file.sum && sync && exec sleep 100000'
READ_DATA='sha256sum /data/file | cut -c1-64 > /tmp/now.sum; exec sleep 100000'

storage_classes() {
    kc apply -f "$E2E_ROOT/deploy/examples/storageclass.yaml" \
        -f "$E2E_ROOT/deploy/examples/storageclass-block.yaml" \
        -f "$E2E_ROOT/deploy/examples/volumesnapshotclass.yaml" \
        -f "$E2E_ROOT/deploy/examples/volumegroupsnapshotclass.yaml" \
        -f "$E2E_ROOT/deploy/examples/volumeattributesclass.yaml" >/dev/null
    # xfs, to show online expansion on a machine that refuses it for ext4, and
    # an Immediate class, so that claims bind without pods
    kc apply -f - >/dev/null <<EOF
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: e2e-xfs}
provisioner: example.csi.k8s.io
parameters: {type: ssd, csi.storage.k8s.io/fstype: xfs}
reclaimPolicy: Delete
allowVolumeExpansion: true
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: e2e-immediate}
provisioner: example.csi.k8s.io
parameters: {type: default}
reclaimPolicy: Delete
volumeBindingMode: Immediate
EOF
}

# The StorageClass of the design: a 10Gi claim stays Pending until a pod is
# scheduled, then binds to a volume on this node and holds what the pod wrote.
scenario_provision() {
    scenario "provision: WaitForFirstConsumer claim, pod writes data"
    pvc data 10Gi example-csi
    sleep 3
    check_eq "claim waits for its first consumer" Pending "$(jp pvc/data '{.status.phase}')"
    pod writer data "$WRITE_DATA"
    eventually 120 "pod writer running" pod_running writer || return
    eventually 30 "claim bound" pvc_bound data
    eventually 60 "pod wrote its data" in_pod writer test -s /data/file.sum
    SUM=$(in_pod writer cat /data/file.sum)
    local pv; pv=$(jp pvc/data '{.spec.volumeName}')
    check_eq "PV made by our driver" example.csi.k8s.io "$(kc get pv "$pv" -o jsonpath='{.spec.csi.driver}')"
    check_eq "PV pinned by our topology key to the node the pod runs on" "$(jp pod/writer '{.spec.nodeName}')" \
        "$(node_of_pvc data)"
    check_eq "PV capacity" 10Gi "$(kc get pv "$pv" -o jsonpath='{.spec.capacity.storage}')"
    local file; file=$(image_of data ssd)
    check "the volume's image is in that node's ssd pool" test -f "$file"
    check_eq "image size is the claim's size" $((10 << 30)) "$(stat -c %s "$file" 2>/dev/null)"
    local blocks; blocks=$(( $(stat -c %b "$file") * 512 ))
    check "the image is sparse (holds $((blocks >> 20)) MiB of 10 GiB)" test "$blocks" -lt $((1 << 30))
    check_eq "the pod sees a 10Gi ext4 filesystem" ext4 \
        "$(in_pod writer sh -c 'grep " /data " /proc/mounts' | awk '{print $3}')"
    local size; size=$(in_pod writer df -k /data | awk 'NR==2 {print $2}')
    check "its size is about 10 GiB ($size KiB)" test "$size" -gt $((9 << 20))
}

# A snapshot of the claim; a claim restored from it and a clone of the claim
# hold the same data.
scenario_snapshot_restore_clone() {
    scenario "snapshot, restore and clone"
    [ -n "${SUM:-}" ] || { fail "no data from the provision scenario"; return; }
    apply <<EOF
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: snap}
spec:
  volumeSnapshotClassName: example-csi
  source: {persistentVolumeClaimName: data}
EOF
    eventually 120 "snapshot ready to use" field_is volumesnapshot/snap '{.status.readyToUse}' true || return
    local content handle
    content=$(jp volumesnapshot/snap '{.status.boundVolumeSnapshotContentName}')
    handle=$(kc get volumesnapshotcontent "$content" -o jsonpath='{.status.snapshotHandle}')
    check "the snapshot is a file in the pool of its volume's node ($handle)" \
        test -e "$(pool_dir "$(node_of_pvc data)" ssd)/snapshots/$(bare_id "$handle").img"
    check_eq "snapshot size" 10Gi "$(jp volumesnapshot/snap '{.status.restoreSize}')"
    pvc restored 10Gi example-csi Filesystem "  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: snap}"
    pvc clone 10Gi example-csi Filesystem "  dataSource: {kind: PersistentVolumeClaim, name: data}"
    pod reader-restored restored "$READ_DATA"
    pod reader-clone clone "$READ_DATA"
    local p
    for p in reader-restored reader-clone; do
        eventually 120 "pod $p running" pod_running $p || continue
        eventually 30 "$p read the data" in_pod $p test -s /tmp/now.sum
        check_sum "$p sees the same checksum" "$SUM" "$(in_pod $p cat /tmp/now.sum)"
    done
    local a b
    a=$(image_of restored ssd); b=$(image_of clone ssd)
    check "restore and clone are volumes of their own in the ssd pool of their node" \
        test -f "$a" -a -f "$b" -a "$a" != "$b"
    delete_pod reader-restored reader-clone
    kc -n "$NS" delete pvc restored clone --wait=true --timeout=120s >/dev/null
    eventually 60 "restore and clone deleted from the pool" test ! -e "$a" -a ! -e "$b"

    # A crash-consistent class: the claim in use is copied without a freeze,
    # and its restore (the journal replayed at its first mount) holds what
    # the pod had written and synced.
    kc apply -f "$E2E_ROOT/deploy/examples/volumesnapshotclass-crash-consistent.yaml" >/dev/null
    apply <<EOF
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: snap-crash}
spec:
  volumeSnapshotClassName: example-csi-crash-consistent
  source: {persistentVolumeClaimName: data}
EOF
    eventually 120 "crash-consistent snapshot ready to use" field_is volumesnapshot/snap-crash '{.status.readyToUse}' true || return
    pvc restored-crash 10Gi example-csi Filesystem "  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: snap-crash}"
    pod reader-crash restored-crash "$READ_DATA"
    if eventually 120 "pod reader-crash running" pod_running reader-crash; then
        eventually 30 "reader-crash read the data" in_pod reader-crash test -s /tmp/now.sum
        check_sum "the crash-consistent snapshot's restore sees the same checksum" "$SUM" "$(in_pod reader-crash cat /tmp/now.sum)"
    fi
    delete_pod reader-crash
    kc -n "$NS" delete pvc restored-crash --wait=true --timeout=120s >/dev/null
    kc -n "$NS" delete volumesnapshot snap-crash --wait=true --timeout=120s >/dev/null
}

# can_grow_ext4_online: whether this kernel lets resize2fs grow a mounted ext4
# (it needs CAP_SYS_RESOURCE, which some VMs withhold even from root).
can_grow_ext4_online() {
    local eff; eff=$(awk '/^CapEff/ {print $2}' /proc/self/status)
    (( (16#$eff >> 24) & 1 ))
}

# Expansion while the pod runs: xfs grows online; ext4 online where the kernel
# allows it, else at the next stage (the pod restarted), as documented.
scenario_expand() {
    scenario "expansion of a claim in use (10Gi -> 20Gi)"
    pvc grow-xfs 10Gi e2e-xfs
    pod grower-xfs grow-xfs "exec sleep 100000"
    eventually 120 "xfs pod running" pod_running grower-xfs || return
    kc -n "$NS" patch pvc grow-xfs -p '{"spec":{"resources":{"requests":{"storage":"20Gi"}}}}' >/dev/null
    eventually 120 "xfs claim reports 20Gi" field_is pvc/grow-xfs '{.status.capacity.storage}' 20Gi
    eventually 60 "the running pod sees about 20 GiB on xfs" \
        df_over grower-xfs /data $((19 << 20))
    local vol; vol=$(volume_of grow-xfs)
    check_eq "the image grew to 20 GiB" $((20 << 30)) "$(stat -c %s "$(pool_file_of "$vol")")"

    [ -n "${SUM:-}" ] || return
    if [ "$FLAVOR" = distributed ] && ! can_grow_ext4_online; then
        # Only NodeExpandVolume grows a volume in this flavor, and the kubelet
        # calls it with the filesystem mounted: ext4 cannot grow here.
        echo "  NOT RUN  ext4 expansion: the distributed flavor grows on the node only, and this kernel refuses online ext4 growth (no CAP_SYS_RESOURCE)"
        delete_pod grower-xfs
        return
    fi
    kc -n "$NS" patch pvc data -p '{"spec":{"resources":{"requests":{"storage":"20Gi"}}}}' >/dev/null
    if can_grow_ext4_online; then
        eventually 120 "ext4 claim reports 20Gi (online)" field_is pvc/data '{.status.capacity.storage}' 20Gi
    else
        echo "  (this kernel refuses online ext4 growth without CAP_SYS_RESOURCE: the pod is restarted)"
        eventually 120 "ext4 resize waits for the node" pvc_condition data 'FileSystemResizePending|NodeResizeError'
        delete_pod writer
        pod writer data "$READ_DATA"
        eventually 120 "pod restarted on the claim" pod_running writer
        eventually 120 "ext4 claim reports 20Gi (grown at stage)" field_is pvc/data '{.status.capacity.storage}' 20Gi
    fi
    eventually 60 "the pod sees about 20 GiB on ext4" \
        df_over writer /data $((19 << 20))
    check_sum "data intact after growth" "$SUM" "$(in_pod writer sha256sum /data/file | cut -c1-64)"
    delete_pod grower-xfs
}

scenario_block() {
    scenario "raw block claim"
    pvc raw 1Gi example-csi-block Block
    block_pod blocky raw "dd if=/dev/urandom of=/tmp/x bs=1M count=4 2>/dev/null && dd if=/tmp/x of=/dev/xvda bs=1M count=4 conv=fsync 2>/dev/null && sha256sum /tmp/x | cut -c1-64 > /tmp/x.sum && exec sleep 100000"
    eventually 120 "block pod running" pod_running blocky || return
    eventually 30 "pod wrote to the device" in_pod blocky test -s /tmp/x.sum
    check "the pod sees a block device" in_pod blocky test -b /dev/xvda
    check_sum "the device's data reads back" "$(in_pod blocky cat /tmp/x.sum)" \
        "$(in_pod blocky sh -c 'dd if=/dev/xvda bs=1M count=4 2>/dev/null | sha256sum | cut -c1-64')"
    local vol; vol=$(volume_of raw)
    check_sum "the image's first 4 MiB are what the pod wrote" "$(in_pod blocky cat /tmp/x.sum)" \
        "$(dd if="$(pool_file_of "$vol")" bs=1M count=4 2>/dev/null | sha256sum | cut -c1-64)"
    delete_pod blocky
}

scenario_ephemeral() {
    scenario "generic ephemeral volume and CSI inline volume"
    apply <<EOF
apiVersion: v1
kind: Pod
metadata: {name: eph, labels: {e2e: "true"}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: app
      image: $BUSYBOX_IMAGE
      imagePullPolicy: Never
      command: ["sh", "-c", "echo hi > /scratch/f && exec sleep 100000"]
      volumeMounts: [{name: scratch, mountPath: /scratch}, {name: inline, mountPath: /inline}]
  volumes:
    - name: scratch
      ephemeral:
        volumeClaimTemplate:
          spec:
            accessModes: [ReadWriteOnce]
            storageClassName: example-csi
            resources: {requests: {storage: 1Gi}}
    - name: inline
      csi:
        driver: example.csi.k8s.io
        fsType: ext4
        volumeAttributes: {size: 256Mi}
EOF
    eventually 120 "pod with both volumes running" pod_running eph || return
    check "generic ephemeral claim eph-scratch bound" pvc_bound eph-scratch
    check "the pod writes to its generic ephemeral volume" in_pod eph test -s /scratch/f
    local isize; isize=$(in_pod eph df -k /inline | awk 'NR==2 {print $2}')
    check "the inline volume is an ext4 of about 256 MiB ($isize KiB)" \
        test "$isize" -gt 200000 -a "$isize" -lt 270000
    local eph_files; eph_files=$(find "${POOL_DIRS[@]/%//ephemeral}" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
    check "the inline volume lives in a pool's ephemeral area ($eph_files)" test "$eph_files" -ge 1
    local vol; vol=$(volume_of eph-scratch)
    delete_pod eph
    eventually 60 "the generic ephemeral claim goes with its pod" gone pvc/eph-scratch
    eventually 60 "its volume is deleted from the pool" not pool_file_of "$vol"
    eventually 60 "the inline volume is deleted with its pod" empty_dirs "${POOL_DIRS[@]/%//ephemeral}"
}

scenario_modify() {
    scenario "VolumeAttributesClass change (ControllerModifyVolume)"
    if [ "$FLAVOR" = distributed ]; then
        # external-resizer runs once in this flavor, beside a driver that holds
        # no node's volumes: ControllerModifyVolume cannot reach them.
        echo "  NOT RUN  the distributed flavor's single resizer cannot modify a node's volumes"
        return
    fi
    pvc attrs 1Gi e2e-immediate
    eventually 60 "claim bound" pvc_bound attrs || return
    kc -n "$NS" patch pvc attrs -p '{"spec":{"volumeAttributesClassName":"example-csi-fast"}}' >/dev/null
    eventually 120 "claim now has class example-csi-fast" \
        field_is pvc/attrs '{.status.currentVolumeAttributesClassName}' example-csi-fast
    local f; f=$(pool_file_of "$(volume_of attrs)")
    check_eq "directIO recorded on the volume" true "$(getfattr --only-values -n user.example-csi.directIO "$f" 2>/dev/null)"
    check_eq "readAheadKiB recorded on the volume" 1024 "$(getfattr --only-values -n user.example-csi.readAheadKiB "$f" 2>/dev/null)"
    # In use: the stage gives the loop device what is recorded, and a change
    # while the pod runs reaches the device at once (in the central flavor the
    # controller hands it to the node plugin's process).
    pod attrs attrs "exec sleep 100000"
    eventually 120 "a pod on the claim running" pod_running attrs || return
    check_eq "the staged volume's loop device has the class's settings" "1 1024" "$(loop_settings_of "$f")"
    apply <<EOF
apiVersion: storage.k8s.io/v1
kind: VolumeAttributesClass
metadata: {name: e2e-slow}
driverName: example.csi.k8s.io
parameters: {directIO: "false", readAheadKiB: "256"}
EOF
    kc -n "$NS" patch pvc attrs -p '{"spec":{"volumeAttributesClassName":"e2e-slow"}}' >/dev/null
    eventually 120 "claim in use now has class e2e-slow" \
        field_is pvc/attrs '{.status.currentVolumeAttributesClassName}' e2e-slow
    check_eq "the loop device serving the pod changed at once" "0 256" "$(loop_settings_of "$f")"
    check "the pod still writes" in_pod attrs sh -c 'echo x > /data/after && sync'
    delete_pod attrs
    kc delete volumeattributesclass e2e-slow --wait=false >/dev/null
}

# loop_settings_of FILE: "DIO READ_AHEAD_KB" of the loop device serving FILE.
loop_settings_of() {
    local dev; dev=$(loops_of "$1" | head -n1)
    [ -n "$dev" ] || { echo "no loop device"; return; }
    dev=${dev#/dev/}
    echo "$(cat "/sys/block/$dev/loop/dio") $(cat "/sys/block/$dev/queue/read_ahead_kb")"
}

scenario_group_snapshot() {
    scenario "VolumeGroupSnapshot of two claims"
    if [ "$FLAVOR" = distributed ]; then
        # csi-snapshotter's per-node mode takes single snapshots only.
        echo "  NOT RUN  csi-snapshotter with --node-deployment does not make group snapshots"
        return
    fi
    # A group's members are on one node: with more than one, the claims are
    # made on the node they name (the annotation the scheduler would set), on
    # each node in turn.
    local n i=0
    for n in $(nodes_up); do
        local ann=""
        [ "$(nodes_up | grep -c .)" -gt 1 ] && ann="volume.kubernetes.io/selected-node: $n"
        PVC_LABELS="group: pair$i" PVC_ANNOTATIONS=$ann pvc "g$i-1" 1Gi e2e-immediate
        PVC_LABELS="group: pair$i" PVC_ANNOTATIONS=$ann pvc "g$i-2" 1Gi e2e-immediate
        eventually 60 "both claims bound" all_of "pvc_bound g$i-1" "pvc_bound g$i-2" || return
        check_eq "both on node $n" "$n $n" "$(node_of_pvc "g$i-1") $(node_of_pvc "g$i-2")"
        apply <<EOF
apiVersion: groupsnapshot.storage.k8s.io/v1
kind: VolumeGroupSnapshot
metadata: {name: pair$i}
spec:
  volumeGroupSnapshotClassName: example-csi
  source: {selector: {matchLabels: {group: pair$i}}}
EOF
        eventually 120 "group snapshot of two volumes on $n ready" \
            field_is "volumegroupsnapshot/pair$i" '{.status.readyToUse}' true || return
        check_eq "one member snapshot per claim" 2 "$(group_members "pair$i")"
        local before; before=$(kc -n "$NS" get volumesnapshot -o name | grep -c .)
        kc -n "$NS" delete volumegroupsnapshot "pair$i" --wait=true --timeout=120s >/dev/null
        eventually 60 "member snapshots gone with the group" \
            count_is $((before - 2)) kc -n "$NS" get volumesnapshot -o name
        i=$((i + 1))
    done
    # With the cluster flavor, a group of claims on two nodes: taken in parts
    # of one instant, its members on their own nodes.
    [ "$FLAVOR" = cluster ] && [ "$(nodes_up | grep -c .)" -gt 1 ] || return 0
    local a b
    a=$(nodes_up | sed -n 1p); b=$(nodes_up | sed -n 2p)
    PVC_LABELS="group: across" PVC_ANNOTATIONS="volume.kubernetes.io/selected-node: $a" pvc ga-1 1Gi e2e-immediate
    PVC_LABELS="group: across" PVC_ANNOTATIONS="volume.kubernetes.io/selected-node: $b" pvc ga-2 1Gi e2e-immediate
    eventually 60 "both claims bound" all_of "pvc_bound ga-1" "pvc_bound ga-2" || return
    check_eq "one claim on each node" "$a $b" "$(node_of_pvc ga-1) $(node_of_pvc ga-2)"
    apply <<EOF
apiVersion: groupsnapshot.storage.k8s.io/v1
kind: VolumeGroupSnapshot
metadata: {name: across}
spec:
  volumeGroupSnapshotClassName: example-csi
  source: {selector: {matchLabels: {group: across}}}
EOF
    eventually 120 "group snapshot of volumes on $a and $b ready" \
        field_is "volumegroupsnapshot/across" '{.status.readyToUse}' true || return
    check_eq "one member snapshot per claim" 2 "$(group_members across)"
    check_eq "the members are on both nodes" "$(printf '%s\n' "$a" "$b" | sort | xargs)" "$(member_nodes across)"
    local before; before=$(kc -n "$NS" get volumesnapshot -o name | grep -c .)
    kc -n "$NS" delete volumegroupsnapshot across --wait=true --timeout=120s >/dev/null
    eventually 60 "member snapshots gone with the group" \
        count_is $((before - 2)) kc -n "$NS" get volumesnapshot -o name
}

# member_nodes GROUP: the nodes (sorted) that the snapshot handles of the
# members of the VolumeGroupSnapshot GROUP name.
member_nodes() {
    local snaps contents
    snaps=$(kc -n "$NS" get volumesnapshot -o json)
    contents=$(kc get volumesnapshotcontent -o json)
    python3 -c '
import json, sys
group, snaps, contents = sys.argv[1], json.loads(sys.argv[2])["items"], json.loads(sys.argv[3])["items"]
handle = {c["metadata"]["name"]: c.get("status", {}).get("snapshotHandle", "") for c in contents}
names = [s.get("status", {}).get("boundVolumeSnapshotContentName", "") for s in snaps
         if any(o.get("kind") == "VolumeGroupSnapshot" and o.get("name") == group
                for o in s["metadata"].get("ownerReferences", []))]
print(" ".join(sorted(handle.get(n, "").rsplit("@", 1)[-1] for n in names)))' "$1" "$snaps" "$contents"
}

# group_members GROUP: how many VolumeSnapshots the VolumeGroupSnapshot GROUP owns.
group_members() {
    kc -n "$NS" get volumesnapshot -o json | python3 -c '
import json, sys
items = json.load(sys.stdin)["items"]
print(sum(1 for i in items if any(o.get("kind") == "VolumeGroupSnapshot" and o.get("name") == sys.argv[1]
                                  for o in i["metadata"].get("ownerReferences", []))))' "$1"
}

scenario_fsgroup() {
    scenario "fsGroup through VOLUME_MOUNT_GROUP (contents given once, on a new group)"
    pvc shared 1Gi example-csi
    pod first shared "touch /data/old && exec sleep 100000"
    eventually 120 "root pod running" pod_running first || return
    eventually 30 "root pod made a file" in_pod first test -e /data/old
    delete_pod first
    local sc="  securityContext: {runAsUser: 1000, runAsGroup: 1000, fsGroup: 2000}"
    pod second shared "exec sleep 100000" "$sc"
    eventually 120 "pod with fsGroup 2000 running" pod_running second || return
    check_eq "volume root owned by group 2000 with setgid" "2000 2" \
        "$(in_pod second sh -c 'stat -c "%g %a" /data | cut -c1-6')"
    check_eq "the earlier pod's file given to the new group" 2000 "$(in_pod second stat -c %g /data/old)"
    check "the pod (uid 1000) can write" in_pod second touch /data/new
    check_eq "a new file takes the group" 2000 "$(in_pod second stat -c %g /data/new)"
    check "the pod gives its file to its own group" in_pod second chgrp 1000 /data/new
    delete_pod second
    pod third shared "exec sleep 100000" "$sc"
    eventually 120 "a pod with the same fsGroup running" pod_running third || return
    check_eq "same group: no walk, the file keeps the group the pod gave it" 1000 \
        "$(in_pod third stat -c %g /data/new)"
    delete_pod third
}

# The node plugin's pod replaced while a pod uses a volume: the new container
# sees the pool and the kubelet's directories by other mounts than the one
# that staged the volume, and must still expand, unpublish and unstage it.
scenario_node_restart() {
    scenario "node plugin restarted while a volume is in use"
    pvc steady 1Gi e2e-xfs
    pod steady steady "$WRITE_DATA"
    eventually 120 "pod on the claim running" pod_running steady || return
    eventually 60 "pod wrote its data" in_pod steady test -s /data/file.sum
    local sum vol image; sum=$(in_pod steady cat /data/file.sum)
    vol=$(volume_of steady); image=$(pool_file_of "$vol")
    local old mounts; old=$(node_plugin_pods); mounts=$(pool_mounts | tr '\n' ' ')
    kc -n "$DRIVER_NS" delete pod -l app.kubernetes.io/component=node --wait=true --timeout=120s >/dev/null
    eventually 180 "a new node plugin is ready" node_plugin_replaced "$old" || return
    check_eq "its start stacks no copy of a pool's mount on any node (mounts at each pool)" "$mounts" \
        "$(pool_mounts | tr '\n' ' ')"
    check_sum "the pod still reads its data" "$sum" "$(in_pod steady sha256sum /data/file | cut -c1-64)"
    kc -n "$NS" patch pvc steady -p '{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}' >/dev/null
    eventually 120 "the claim grows to 2Gi through the new node plugin" field_is pvc/steady '{.status.capacity.storage}' 2Gi
    eventually 60 "the running pod sees about 2 GiB" df_over steady /data $((1900 << 10))
    kc -n "$NS" delete pod steady --wait=false >/dev/null
    eventually 120 "the pod is deleted (its volume unpublished)" gone pod/steady
    eventually 60 "its volume unstaged: no loop device on the image" count_is 0 loops_of "$image"
    pod steady-again steady "$READ_DATA"
    eventually 120 "a new pod on the claim running" pod_running steady-again || return
    check_sum "the data is intact" "$sum" "$(in_pod steady-again cat /tmp/now.sum)"
    delete_pod steady-again
    kc -n "$NS" delete pvc steady --wait=true --timeout=120s >/dev/null
    eventually 60 "the volume deleted from the pool" not test -e "$image"
}

node_plugin_pods() {
    kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' | sort
}
# node_plugin_replaced OLD: node plugin pods other than OLD's, all ready.
node_plugin_replaced() {
    local now; now=$(node_plugin_pods)
    [ -n "$now" ] && [ -z "$(comm -12 <(echo "$1") <(echo "$now"))" ] || return 1
    kc -n "$DRIVER_NS" wait pod -l app.kubernetes.io/component=node --for=condition=Ready --timeout=5s >/dev/null
}
# loops_of FILE: loop devices attached to FILE (by its device and inode).
loops_of() {
    local id; id=$(stat -c '%Hd:%Ld %i' "$1" 2>/dev/null) || return 0
    losetup -n -O NAME,BACK-MAJ:MIN,BACK-INO 2>/dev/null | awk -v id="$id" '$2 " " $3 == id {print $1}'
}

# Two nodes, each with its own pools and node plugin (the distributed and
# cluster flavors): the driver registers on the second node with its own
# topology, capacity is published per node, a claim is made in the pool of
# the node its pod is pinned to, and a pod that names no node goes to where
# its volume is.
scenario_two_nodes() {
    scenario "two nodes: per-node provisioning, capacity and scheduling"
    local second=${NODES[1]}
    second_node_up
    eventually 180 "the node plugin runs on both nodes" node_plugin_on_nodes 2 || return
    eventually 120 "the kubelet of $second registered the driver" csinode_has_driver "$second" || return
    check_eq "$second carries its own topology label" "$second" \
        "$(kc get node "$second" -o jsonpath='{.metadata.labels.topology\.example\.csi/node}')"
    local n
    for n in "${NODES[@]}"; do
        eventually 120 "CSIStorageCapacity of the ssd class for $n" capacity_for example-csi "$n"
    done
    # e2e-xfs provisions in the ssd pool
    local i
    local -a pools=("$(pool_dir "${NODES[0]}" ssd)" "$(pool_dir "${NODES[1]}" ssd)") images=()
    for i in 0 1; do
        n=${NODES[$i]}
        pvc "on-$i" 1Gi e2e-xfs
        pod "on-$i" "on-$i" "$WRITE_DATA" "$(on_node "$n")"
    done
    for i in 0 1; do
        n=${NODES[$i]}
        eventually 120 "pod pinned to $n running" pod_running "on-$i" || return
        eventually 60 "pod on $n wrote its data" in_pod "on-$i" test -s /data/file.sum
        local vol; vol=$(bare_id "$(volume_of "on-$i")")
        check_eq "the PV of the claim used on $n is pinned to $n" "$n" "$(node_of_pvc "on-$i")"
        check "its image is in the pool of $n" test -f "${pools[$i]}/volumes/$vol.img"
        check "and not in the other node's pool" not test -e "${pools[$((1 - i))]}/volumes/$vol.img"
        images+=("${pools[$i]}/volumes/$vol.img")
    done
    local -a sums=("$(in_pod on-0 cat /data/file.sum)" "$(in_pod on-1 cat /data/file.sum)")
    check "both pods' checksums read (${sums[0]:0:8}.., ${sums[1]:0:8}..)" is_sum "${sums[0]}" "${sums[1]}"
    if [ "$FLAVOR" = cluster ]; then
        check "the router's metrics count both claims' CreateVolume" \
            created_at_least "$(router_metrics_url)" 2
    fi
    delete_pod on-0 on-1
    for i in 0 1; do
        pod "again-$i" "on-$i" "$READ_DATA"
    done
    for i in 0 1; do
        n=${NODES[$i]}
        eventually 120 "a pod naming no node, on the claim made on $n, running" pod_running "again-$i" || continue
        check_eq "it was scheduled to where its volume is" "$n" "$(jp "pod/again-$i" '{.spec.nodeName}')"
        check_sum "it reads the data written there" "${sums[$i]}" "$(in_pod "again-$i" cat /tmp/now.sum)"
    done
    delete_pod again-0 again-1
    kc -n "$NS" delete pvc on-0 on-1 --wait=true --timeout=120s >/dev/null
    eventually 60 "both volumes deleted from their node's pool" not ls "${images[@]}"
}

# What the pods of the cross-node scenarios write: 64 MiB of random data and a
# file with holes (1 MiB of data at 100 MiB and at 700 MiB), their checksums
# and the holey file's allocated KiB.
MOVE_WRITE='dd if=/dev/urandom of=/data/random bs=1M count=64 2>/dev/null && dd if=/dev/urandom of=/data/holey bs=1M count=1 seek=100 2>/dev/null && dd if=/dev/urandom of=/data/holey bs=1M count=1 seek=700 conv=notrunc 2>/dev/null && sync && sha256sum /data/random /data/holey > /data/sums.tmp && du -k /data/holey | cut -f1 > /data/holey.du && mv /data/sums.tmp /data/sums && sync && exec sleep 100000'
MOVE_READ='sha256sum /data/random /data/holey > /tmp/sums.tmp && du -k /data/holey | cut -f1 > /tmp/holey.du && mv /tmp/sums.tmp /tmp/sums; exec sleep 100000'

# Volumes that follow their workload (the cluster flavor): a claim written on
# the first node; a VolumeSnapshot of it restored into a claim, and a clone of
# it made, each used by a pod pinned to the second node. The second node pulls
# the data from the first over the mesh; its pods read byte for byte what was
# written, holes stay holes, the PVs name the second node, and the transfer is
# told on the claim (Events) and by `csi-driver client transfers`.
scenario_across_nodes() {
    scenario "restore and clone on the other node: the data follows"
    local a=${NODES[0]} b=${NODES[1]}
    source_claim src "$a" "$MOVE_WRITE" /data/sums "64 MiB of random data and a file with holes" || return
    local want holes
    want=$(in_pod src cat /data/sums); holes=$(in_pod src cat /data/holey.du)
    take_snapshot src-snap src || return
    # The restore's VolumeAttributesClass paces its transfer at 1 MiB/s (the
    # 66 MiB of data would take a minute), until the claim gets a class
    # without a cap.
    kc apply -f - >/dev/null <<EOF
apiVersion: storage.k8s.io/v1
kind: VolumeAttributesClass
metadata: {name: e2e-transfer-paced}
driverName: example.csi.k8s.io
parameters: {transferBandwidth: 1Mi}
---
apiVersion: storage.k8s.io/v1
kind: VolumeAttributesClass
metadata: {name: e2e-transfer-free}
driverName: example.csi.k8s.io
parameters: {transferBandwidth: "0"}
EOF
    pvc src-restored 2Gi e2e-xfs Filesystem "  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: src-snap}
  volumeAttributesClassName: e2e-transfer-paced"
    pvc src-clone 2Gi e2e-xfs Filesystem "  dataSource: {kind: PersistentVolumeClaim, name: src}"
    pod on-b-restored src-restored "$MOVE_READ" "$(on_node "$b")"
    pod on-b-clone src-clone "$MOVE_READ" "$(on_node "$b")"
    transfer_paced_then_freed src-restored
    local c source_image; source_image=$(image_of src ssd)
    for c in restored clone; do
        local claim=src-$c p=on-b-$c
        eventually 180 "the pod on $b with the $c claim running" pod_running "$p" || continue
        eventually 60 "it read the data" in_pod "$p" test -s /tmp/sums || continue
        check_eq "the $c claim's PV is on $b (the volume's real topology)" "$b" "$(node_of_pvc "$claim")"
        check_eq "the pod on $b reads byte for byte what was written on $a" "$want" "$(in_pod "$p" cat /tmp/sums)"
        check_eq "the holey file keeps its holes ($holes KiB allocated of 701 MiB)" "$holes" "$(in_pod "$p" cat /tmp/holey.du)"
        local image; image=$(image_of "$claim" ssd)
        check "its image is in the ssd pool of $b" test -f "$image"
        local got src_blocks
        got=$(( $(stat -c %b "$image" 2>/dev/null || echo 0) * 512 ))
        src_blocks=$(( $(stat -c %b "$source_image" 2>/dev/null || echo 0) * 512 ))
        check "only what was allocated arrived: $((got >> 20)) MiB of 2 GiB (the source holds $((src_blocks >> 20)) MiB)" \
            test "$got" -gt $((64 << 20)) -a "$got" -le $((src_blocks + (64 << 20)))
        eventually 60 "Event TransferDone on the $c claim" claim_event_is "$claim" TransferDone
        local sent incremental
        read -r _ _ _ _ sent incremental <<<"$(transfers_of "$claim" | head -1)"
        check "csi-driver client transfers on the controller lists it done, whole ($((${sent:-0} >> 20)) MiB of data sent, incremental: $incremental)" \
            transfer_done_whole "$claim"
    done
    delete_pod on-b-restored on-b-clone src
    kc -n "$NS" delete pvc src-restored src-clone --wait=true --timeout=120s >/dev/null
    kc -n "$NS" delete volumesnapshot src-snap --wait=true --timeout=120s >/dev/null
    kc -n "$NS" delete pvc src --wait=true --timeout=120s >/dev/null
    kc delete volumeattributesclass e2e-transfer-paced e2e-transfer-free --wait=false >/dev/null
}

# transfer_paced_then_freed CLAIM: the arrival of CLAIM (of the class
# e2e-transfer-paced, 1 MiB/s) is still running 8 s after it started; the
# claim given the class e2e-transfer-free (external-resizer, then
# ControllerModifyVolume through the router to the arriving node), its data
# is whole well before the cap would have let it be.
transfer_paced_then_freed() {
    local claim=$1 state got total
    eventually 120 "the data of $claim arriving" transfer_in_state "$claim" running || return
    sleep 8
    read -r state got total _ <<<"$(transfers_of "$claim" | head -1)"
    check "its class's 1 MiB/s paces it: still $state after 8 s, $((${got:-0} >> 20)) MiB durable of $((${total:-0} >> 20)) MiB" \
        test "$state" = running -a "${got:-0}" -lt $((24 << 20))
    local start=$SECONDS
    kc -n "$NS" patch pvc "$claim" -p '{"spec":{"volumeAttributesClassName":"e2e-transfer-free"}}' >/dev/null
    eventually 60 "the claim has the class without a cap" \
        field_is "pvc/$claim" '{.status.currentVolumeAttributesClassName}' e2e-transfer-free
    eventually 60 "its data whole" transfer_done_whole "$claim"
    check "whole $((SECONDS - start)) s after the class changed (at 1 MiB/s the rest needed about a minute)" \
        test $((SECONDS - start)) -lt 40
}

# transfer_in_state CLAIM STATE: the claim's arrival is in STATE.
transfer_in_state() {
    local state
    read -r state _ <<<"$(transfers_of "$1" | head -1)"
    [ "$state" = "$2" ]
}

# A directory volume's tree: nested folders, random data, a file with holes,
# a symlink and a mode; its listing (type, mode, link target), file sizes and sums,
# as the writer made them and as a reader on another node finds them.
# (No double quote: the command goes into a YAML string.)
# shellcheck disable=SC2016
DIR_LIST='cd /data && find . -path ./tree -prune -o -print | sort | while read -r f; do stat -c %F:%a:%N $f; done; stat -c %s:%n holey d/e/random; sha256sum d/e/random holey'
DIR_WRITE='mkdir -p /data/d/e /data/empty && dd if=/dev/urandom of=/data/d/e/random bs=1M count=16 2>/dev/null && dd if=/dev/urandom of=/data/holey bs=1M count=1 seek=300 2>/dev/null && ln -s d/e/random /data/link && chmod 0750 /data/d && sync && ('"$DIR_LIST"') > /tmp/tree && mv /tmp/tree /data/tree && sync && exec sleep 100000'
DIR_READ='('"$DIR_LIST"') > /tmp/tree.tmp && du -k /data/holey | cut -f1 > /tmp/holey.du && mv /tmp/tree.tmp /tmp/tree; exec sleep 100000'

# Directory volumes follow their workload too (the cluster flavor): a `kind:
# dir` claim written on the first node, restored from its snapshot and
# cloned for pods pinned to the second, which find the same tree.
scenario_across_nodes_dir() {
    scenario "restore and clone of a directory volume on the other node: the tree follows"
    local a=${NODES[0]} b=${NODES[1]}
    kc apply -f - >/dev/null <<EOF
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: e2e-dir}
provisioner: example.csi.k8s.io
parameters: {type: ssd, kind: dir}
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
EOF
    pvc dsrc 1Gi e2e-dir
    pod dsrc dsrc "$DIR_WRITE" "$(on_node "$a")"
    eventually 120 "the source's pod on $a running" pod_running dsrc || return
    eventually 120 "it wrote its tree" in_pod dsrc test -s /data/tree || return
    check_eq "the source claim's PV is on $a" "$a" "$(node_of_pvc dsrc)"
    local want; want=$(in_pod dsrc cat /data/tree)
    take_snapshot dsrc-snap dsrc || return
    pvc dsrc-restored 1Gi e2e-dir Filesystem "  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: dsrc-snap}"
    pvc dsrc-clone 1Gi e2e-dir Filesystem "  dataSource: {kind: PersistentVolumeClaim, name: dsrc}"
    pod on-b-drestored dsrc-restored "$DIR_READ" "$(on_node "$b")"
    pod on-b-dclone dsrc-clone "$DIR_READ" "$(on_node "$b")"
    local c
    for c in restored clone; do
        local claim=dsrc-$c p=on-b-d$c
        eventually 180 "the pod on $b with the $c claim running" pod_running "$p" || continue
        eventually 60 "it read the tree" in_pod "$p" test -s /tmp/tree || continue
        check_eq "the $c claim's PV is on $b" "$b" "$(node_of_pvc "$claim")"
        check_eq "the pod on $b finds the tree written on $a (types, modes, sizes, link, sums)" "$want" "$(in_pod "$p" cat /tmp/tree)"
        local du; du=$(in_pod "$p" cat /tmp/holey.du)
        check "the file with holes keeps them (${du:-?} KiB allocated of 301 MiB)" test "${du:-999999}" -lt 4096
        eventually 60 "Event TransferDone on the $c claim" claim_event_is "$claim" TransferDone
        check "csi-driver client transfers on the controller lists it done, whole" transfer_done_whole "$claim"
    done
    delete_pod on-b-drestored on-b-dclone dsrc
    kc -n "$NS" delete pvc dsrc-restored dsrc-clone --wait=true --timeout=120s >/dev/null
    kc -n "$NS" delete volumesnapshot dsrc-snap --wait=true --timeout=120s >/dev/null
    kc -n "$NS" delete pvc dsrc --wait=true --timeout=120s >/dev/null
}

# source_claim CLAIM NODE COMMAND DONE_FILE WHAT: a 2Gi xfs claim used by a
# pod of the same name pinned to NODE, running COMMAND, which has written
# WHAT once DONE_FILE is there.
source_claim() {
    pvc "$1" 2Gi e2e-xfs
    pod "$1" "$1" "$3" "$(on_node "$2")"
    eventually 120 "the source's pod on $2 running" pod_running "$1" || return
    eventually 300 "it wrote $5" in_pod "$1" test -s "$4" || return
    check_eq "the source claim's PV is on $2" "$2" "$(node_of_pvc "$1")"
}

# claim_event_is CLAIM REASON: an Event of REASON on the claim.
claim_event_is() {
    kc -n "$NS" get events --field-selector "involvedObject.kind=PersistentVolumeClaim,involvedObject.name=$1,reason=$2" \
        -o name 2>/dev/null | grep -q .
}

# transfers_of CLAIM: "STATE BYTES_DONE BYTES_TOTAL RESUMED DATA_BYTES
# INCREMENTAL" of each arrival for CLAIM the router lists (`csi-driver client
# transfers` in the controller pod: every node's).
transfers_of() {
    kc -n "$DRIVER_NS" exec deploy/example-csi-controller -c csi-driver -- \
        csi-driver client --output json transfers 2>/dev/null | python3 -c '
import json, sys
try:
    transfers = json.load(sys.stdin).get("transfers", [])
except ValueError:
    sys.exit(1)
for t in transfers:
    if t.get("role") == "arriving" and t.get("claim") == sys.argv[1]:
        print(t["state"], t["bytes_done"], t["bytes_total"], t["resumed"], t.get("data_bytes", 0),
              str(t["incremental"]).lower())' "$NS/$1"
}

# transfer_done_whole CLAIM: the claim's arrival is done, every byte of it.
transfer_done_whole() {
    local state got total
    read -r state got total _ <<<"$(transfers_of "$1" | head -1)"
    [ "$state" = "done" ] && [ -n "$total" ] && [ "$got" = "$total" ]
}

# A volume moving while something breaks: 512 MiB of random data written on
# the first node, its snapshot restored for a pod pinned to the second; once
# data is arriving (the first durable checkpoint the second node's metrics
# show), one of:
#   cut          the pods' subnets of the two nodes cut from each other
#                (iptables DROP both ways) for CUT_SECONDS: the transfer makes
#                no progress, then goes on once the network is back. 30 s:
#                longer than the agents' HTTP/2 keepalive (a ping every 15 s,
#                10 s to answer) takes to see the connection dead.
#   kill-target  the second node's driver killed (SIGKILL), as a crash would:
#                the kubelet starts its container again and it goes on.
#   kill-source  the first node's driver killed the same way: the second
#                waits for it and goes on once it is back.
# Either way the transfer goes on from where it was durable (never below it,
# not from zero), the pod reads the data whole, `csi-driver client
# transfers` says done and resumed, and the claim has the Events
# TransferResumed and TransferDone. The restore's class caps its transfer at
# PACED_BANDWIDTH, so that it lasts (16 s) well beyond the time the node's
# metrics may be reused (5 s) whatever the machine's disks: the break comes
# while data is arriving, never after the end.
CUT_SECONDS=30
PACED_BANDWIDTH=32Mi

scenario_network_cut() {
    scenario "the network between the nodes cut during a transfer"
    transfer_broken cut far
}

scenario_agent_killed() {
    scenario "the receiving node's driver killed during a transfer"
    transfer_broken kill-target fark
    scenario "the sending node's driver killed during a transfer"
    transfer_broken kill-source fars
}

# transfer_broken cut|kill-target|kill-source NAME: the steps above, with
# the source claim NAME, its snapshot NAME-snap and the restore NAME-b.
transfer_broken() {
    local how=$1 name=$2 a=${NODES[0]} b=${NODES[1]}
    source_claim "$name" "$a" 'dd if=/dev/urandom of=/data/big bs=1M count=512 2>/dev/null && sync && sha256sum /data/big | cut -c1-64 > /data/big.tmp && mv /data/big.tmp /data/big.sum && exec sleep 100000' \
        /data/big.sum "512 MiB of random data" || return
    local want; want=$(in_pod "$name" cat /data/big.sum)
    take_snapshot "$name-snap" "$name" || return
    delete_pod "$name"
    local metrics; metrics=$(node_metrics_url "$b")
    [ -n "$metrics" ] || { fail "no metrics address of the node plugin on $b"; return; }
    kc apply -f - >/dev/null <<EOF
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: e2e-xfs-paced}
provisioner: example.csi.k8s.io
parameters: {type: ssd, csi.storage.k8s.io/fstype: xfs, transferBandwidth: $PACED_BANDWIDTH}
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
EOF
    pvc "$name-b" 2Gi e2e-xfs-paced Filesystem "  dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: $name-snap}"
    pod "$name-b" "$name-b" 'sha256sum /data/big | cut -c1-64 > /tmp/big.tmp && mv /tmp/big.tmp /tmp/big.sum; exec sleep 100000' "$(on_node "$b")"
    # the break comes at the first durable checkpoint seen, looked at often
    local at_break="" end=$((SECONDS + 120))
    while [ $SECONDS -lt $end ] && ! arriving_bytes_over "$metrics" 0; do sleep 0.2; done
    at_break=$(arriving_bytes "$metrics")
    check "data is arriving on $b ($((${at_break:-0} >> 20)) MiB durable)" test -n "$at_break"
    if [ -z "$at_break" ]; then
        log "what the router lists for the claim (state done total resumed sent incremental): $(transfers_of "$name-b")"
        log "the claim: $(jp "pvc/$name-b" '{.status.phase}'), its pod: $(jp "pod/$name-b" '{.status.phase}'), metrics of $b: $(curl -sf --max-time 3 "$metrics" | grep -c '^example_csi_transfer') transfer lines"
        kc -n "$NS" get events --field-selector "involvedObject.name=$name-b" 2>&1 | tail -5 | sed 's/^/    /'
        return
    fi
    local low_from=$at_break
    case $how in
        cut)
            cut_between_nodes on
            log "network between $a and $b cut for ${CUT_SECONDS}s (at $((at_break >> 20)) MiB durable)"
            sleep 5
            local frozen; frozen=$(arriving_bytes "$metrics")
            sleep $((CUT_SECONDS - 5))
            local after_cut; after_cut=$(arriving_bytes "$metrics")
            cut_between_nodes off
            check "the cut held: no progress in its last $((CUT_SECONDS - 5)) s ($((frozen >> 20)) MiB, then $((after_cut >> 20)) MiB)" \
                test -n "$frozen" -a "$frozen" = "$after_cut"
            check "the transfer was not over when the network went ($((at_break >> 20)) MiB durable)" test -n "$after_cut"
            low_from=${after_cut:-$at_break}
            ;;
        kill-target|kill-source)
            local victim=$b; [ "$how" = kill-source ] && victim=$a
            kill_driver "$victim" || return
            log "the driver on $victim killed (at $((at_break >> 20)) MiB durable on $b)"
            ;;
    esac
    # From here the durable progress only grows: the transfer goes on from its
    # last checkpoint, not from zero. (A restarting driver answers no metrics
    # for a moment: those samples are skipped.)
    local low="" end=$((SECONDS + 300)) now
    while [ $SECONDS -lt $end ] && ! transfer_done_whole "$name-b"; do
        now=$(arriving_bytes "$metrics")
        if [ -n "$now" ] && { [ -z "$low" ] || [ "$now" -lt "$low" ]; }; then low=$now; fi
        sleep 0.5
    done
    check "the transfer went on from where it was durable (never below $((low_from >> 20)) MiB; lowest seen $((${low:-$low_from} >> 20)) MiB)" \
        test "${low:-$low_from}" -ge "$low_from"
    eventually 300 "the pod on $b running once the data is whole" pod_running "$name-b" || return
    eventually 120 "it read the data" in_pod "$name-b" test -s /tmp/big.sum
    check_sum "the pod on $b reads the 512 MiB written on $a" "$want" "$(in_pod "$name-b" cat /tmp/big.sum)"
    local state got total resumed sent
    read -r state got total resumed sent _ <<<"$(transfers_of "$name-b" | head -1)"
    check_eq "csi-driver client transfers: done, every byte ($((${sent:-0} >> 20)) MiB of data sent)" \
        "done $total" "$state $got"
    check "and it says the transfer resumed (resumed $resumed)" test "${resumed:-0}" -ge 1
    eventually 60 "Event TransferResumed on the claim" claim_event_is "$name-b" TransferResumed
    eventually 60 "Event TransferDone on the claim" claim_event_is "$name-b" TransferDone
    delete_pod "$name-b"
    kc -n "$NS" delete pvc "$name-b" --wait=true --timeout=120s >/dev/null
    kc -n "$NS" delete volumesnapshot "$name-snap" --wait=true --timeout=120s >/dev/null
    kc -n "$NS" delete pvc "$name" --wait=true --timeout=120s >/dev/null
    kc delete storageclass e2e-xfs-paced >/dev/null
}

# kill_driver NODE: the driver of the node plugin on NODE killed with SIGKILL
# (its container's process, found through that node's containerd), then
# started again by the kubelet and ready.
kill_driver() {
    local pod restarts id pid
    pod=$(kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node --field-selector "spec.nodeName=$1" \
        -o jsonpath='{.items[0].metadata.name}')
    [ -n "$pod" ] || { fail "no node plugin pod on $1"; return 1; }
    restarts=$(jp "pod/$pod" '{.status.containerStatuses[?(@.name=="csi-driver")].restartCount}' "$DRIVER_NS")
    id=$(jp "pod/$pod" '{.status.containerStatuses[?(@.name=="csi-driver")].containerID}' "$DRIVER_NS")
    pid=$(ctr_ --address "$W/containerd-$1/containerd.sock" -n k8s.io tasks ls 2>/dev/null \
        | awk -v id="${id#containerd://}" '$1 == id {print $2}')
    [ -n "$pid" ] || { fail "no process of the driver's container $id on $1"; return 1; }
    kill -KILL "$pid"
    eventually 120 "the kubelet started the killed driver on $1 again" restarted_after "$pod" "$restarts" || return 1
    eventually 120 "the node plugin on $1 is ready again" \
        kc -n "$DRIVER_NS" wait "pod/$pod" --for=condition=Ready --timeout=5s
}

# node_metrics_url NODE: the metrics address of the node plugin on NODE (its
# pod's address: the host reaches every node's pod subnet).
node_metrics_url() {
    local ip
    ip=$(kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node --field-selector "spec.nodeName=$1" \
        -o jsonpath='{.items[0].status.podIP}')
    [ -n "$ip" ] && echo "http://$ip:9810/metrics"
}

# router_metrics_url: the metrics address of the cluster's controller (its
# router's pod).
router_metrics_url() {
    local ip
    ip=$(kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=controller \
        -o jsonpath='{.items[0].status.podIP}')
    [ -n "$ip" ] && echo "http://$ip:9810/metrics"
}

# created_at_least URL N: the metrics at URL count N or more CreateVolume
# calls answered OK.
created_at_least() {
    local n
    n=$(curl -sf --max-time 3 "$1" | awk '/^example_csi_rpc_requests_total\{/ && /method="CreateVolume"/ && /grpc_code="OK"/ {print $NF; exit}')
    [ -n "$n" ] && awk -v n="$n" -v want="$2" 'BEGIN { exit !(n >= want) }'
}

# arriving_bytes URL: the bytes durable of the volume arriving on that node
# (empty when none is arriving).
arriving_bytes() {
    curl -sf --max-time 3 "$1" | awk '/^example_csi_transfer_bytes_done\{/ {print $NF; exit}'
}
arriving_bytes_over() { local n; n=$(arriving_bytes "$1"); [ -n "$n" ] && [ "$n" -gt "$2" ]; }

# cut_between_nodes on|off: drops, or lets through again, every packet
# between the pod subnets of the first and second node (the node agents'
# addresses).
cut_between_nodes() {
    local op=-I; [ "$1" = off ] && op=-D
    iptables "$op" FORWARD -s "$POD_CIDR_BASE.0.0/24" -d "$POD_CIDR_BASE.1.0/24" -j DROP
    iptables "$op" FORWARD -s "$POD_CIDR_BASE.1.0/24" -d "$POD_CIDR_BASE.0.0/24" -j DROP
}

# node_plugin_on_nodes N: the node plugin's pods ready on N nodes.
node_plugin_on_nodes() {
    [ "$(kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node \
        -o jsonpath='{range .items[?(@.status.phase=="Running")]}{.spec.nodeName}{"\n"}{end}' | sort -u | grep -c .)" = "$1" ] \
        && kc -n "$DRIVER_NS" wait pod -l app.kubernetes.io/component=node --for=condition=Ready --timeout=5s >/dev/null
}

# capacity_of CLASS NODE: "BYTES MAX_BYTES OWNER_KIND/OWNER_NAME" of the
# CSIStorageCapacity of CLASS for NODE's topology (nothing if there is none).
capacity_of() {
    kc get csistoragecapacity -A -o json | python3 -c '
import json, re, sys
cls, node = sys.argv[1], sys.argv[2]
units = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
         "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
def bytes_of(q):
    m = re.fullmatch(r"([0-9]+)([A-Za-z]*)", q or "0")
    return int(m.group(1)) * units[m.group(2)] if m else 0
for c in json.load(sys.stdin)["items"]:
    if c.get("storageClassName") == cls and \
            (c.get("nodeTopology") or {}).get("matchLabels", {}).get("topology.example.csi/node") == node:
        o = (c["metadata"].get("ownerReferences") or [{}])[0]
        print(bytes_of(c.get("capacity")), bytes_of(c.get("maximumVolumeSize")),
              str(o.get("kind")) + "/" + str(o.get("name")))
        break' "$1" "$2"
}

# capacity_for CLASS NODE: a CSIStorageCapacity of CLASS for NODE's topology,
# with some capacity.
capacity_for() { local c; c=$(capacity_of "$1" "$2"); [ -n "$c" ] && [ "${c%% *}" -gt 0 ]; }

# near BYTES WANT: BYTES within 2 % of WANT (the pool changes a little
# between the provisioner's poll and the look at it).
near() { [ -n "$1" ] && [ $(( ($1 - $2) * 50 )) -le "$2" ] && [ $(( ($2 - $1) * 50 )) -le "$2" ]; }

# Storage capacity tracking: external-provisioner publishes, for the class of
# the design, what the node's ssd pool has free, owned by the workload that
# runs it; the scheduler keeps a pod whose claim cannot fit off the node and
# the driver is never asked for the volume.
scenario_capacity() {
    scenario "capacity: CSIStorageCapacity for each node, and a claim too large for it"
    local n
    for n in $(nodes_up); do
        eventually 120 "CSIStorageCapacity of the ssd class for $n" capacity_for example-csi "$n" || return
        local cap max owner free want_owner
        read -r cap max owner <<<"$(capacity_of example-csi "$n")"
        free=$(df -B1 --output=avail "$(pool_dir "$n" ssd)" | tail -1 | tr -d ' ')
        check "published capacity for $n ($cap) is its ssd pool's free space ($free)" near "$cap" "$free"
        check_eq "maximum volume size is the capacity" "$cap" "$max"
        want_owner=Deployment/example-csi-controller
        [ "$FLAVOR" = distributed ] && want_owner="Pod/$(kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node \
            --field-selector "spec.nodeName=$n" -o jsonpath='{.items[0].metadata.name}')"
        check_eq "the capacity object's owner" "$want_owner" "$owner"
    done
    local before; before=$(pool_files)
    pvc huge 1Ti example-csi
    pod huge-user huge "exec sleep 100000"
    eventually 60 "a pod whose claim exceeds the capacity is unschedulable for lack of storage" \
        pod_unschedulable_for huge-user 'enough free storage'
    check_eq "its claim is not provisioned" Pending "$(jp pvc/huge '{.status.phase}')"
    check_eq "the pools are as they were" "$before" "$(pool_files)"
    delete_pod huge-user
    kc -n "$NS" delete pvc huge --wait=true --timeout=60s >/dev/null 2>&1
}

# pod_unschedulable_for POD TEXT: the scheduler reports POD unschedulable with
# a message containing TEXT.
pod_unschedulable_for() {
    jp "pod/$1" '{.status.conditions[?(@.type=="PodScheduled")].reason} {.status.conditions[?(@.type=="PodScheduled")].message}' \
        | grep -q "^Unschedulable .*$2"
}

scenario_churn() {
    scenario "20 claims at once while the controller pod is deleted"
    local before i
    before=$(default_pool_volumes)
    immediate_claims churn 1 10
    kc -n "$DRIVER_NS" delete pod -l app.kubernetes.io/component="$CONTROLLER_COMPONENT" --wait=false >/dev/null
    immediate_claims churn 11 20
    eventually 300 "all 20 claims bound" bound_count_is churn=yes 20
    local pvs
    pvs=$(kc get pv -o jsonpath='{range .items[*]}{.spec.claimRef.name}{"\n"}{end}' | grep -c '^churn-')
    check_eq "one PV per claim" 20 "$pvs"
    local made
    made=$(comm -13 <(echo "$before") <(default_pool_volumes) | grep -c .)
    check_eq "one new image per claim in the pools, none leaked" 20 "$made"
    kc -n "$NS" delete pvc -l churn=yes --wait=true --timeout=180s >/dev/null
    eventually 120 "the 20 volumes deleted from the pools, nothing else" \
        same_list "$before" default_pool_volumes
}

# default_pool_volumes: the volumes in the default pool of every node, sorted.
default_pool_volumes() {
    local n
    for n in $(nodes_up); do find "$(pool_dir "$n" pool)/volumes" -mindepth 1 -maxdepth 1 2>/dev/null; done | sort
}

# immediate_claims NAME FIRST LAST: 64Mi claims NAME-FIRST..NAME-LAST of the
# Immediate class, labelled NAME=yes, in one request.
immediate_claims() {
    local i
    for i in $(seq "$2" "$3"); do
        cat <<EOF
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $1-$i, labels: {e2e: "true", $1: "yes"}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: e2e-immediate
  resources: {requests: {storage: 64Mi}}
EOF
    done | apply
}

# Everything deleted: no PV, no volume file, no mount or loop device of the
# pools, the kubelet's directories clean.
scenario_cleanup() {
    scenario "everything deleted leaves nothing behind"
    kc -n "$NS" delete pod --all --wait=true --timeout=180s >/dev/null 2>&1
    kc -n "$NS" delete volumesnapshot --all --wait=true --timeout=120s >/dev/null 2>&1
    kc -n "$NS" delete pvc --all --wait=true --timeout=180s >/dev/null 2>&1
    eventually 180 "no PersistentVolume left" count_is 0 kc get pv -o name
    eventually 60 "no VolumeSnapshotContent left" count_is 0 kc get volumesnapshotcontent -o name
    eventually 60 "the pools hold no volume or snapshot" count_is 0 pool_files
    eventually 60 "no hold, replica or arrival record of a transfer left on any node" count_is 0 transfer_files \
        || transfer_files | sed 's/^/        /'
    # the kubelet unstages after the pod is gone, on its own schedule
    eventually 60 "no loop device backed by a pool file" count_is 0 pool_loops \
        || losetup -n -O NAME,BACK-MAJ:MIN,BACK-FILE | sed 's/^/        /'
    eventually 60 "no mount of a volume under the kubelet's directory" count_is 0 volume_mounts
    eventually 60 "no staging directory left" count_is 0 find /var/lib/kubelet/plugins/kubernetes.io/csi \
        "$W"/node-*/kubelet/plugins/kubernetes.io/csi -mindepth 2 -maxdepth 4 -type d -name globalmount
}

# Volume and storage health in the API (the kubelet's CSIVolumeHealth gate):
# the kubelet asks the node plugin every volumeStatsAggPeriod and writes what
# it answers into the pod's status and the CSINode's. A volume in use whose
# filesystem turns read-only under it (as ext4's errors=remount-ro does), then
# a pool remounted read-only; each repaired, and its condition goes.
scenario_health() {
    scenario "volume and storage health in Pod.status.volumeHealth and CSINode.status.storageHealth"
    pvc health 1Gi example-csi
    # on the first node, whose mounts the host sees
    pod health health "exec sleep 100000" "$(on_node "$NODE")"
    eventually 120 "pod on the claim running" pod_running health || return
    local image dev staged
    image=$(pool_file_of "$(volume_of health)")
    dev=$(loops_of "$image" | head -1)
    staged=$(findmnt -n -o TARGET -S "$dev" 2>/dev/null | grep '/globalmount$' | head -1)
    [ -n "$staged" ] || { fail "no staging mount of $dev found"; delete_pod health; return; }
    check_eq "a healthy volume has no condition" "" "$(volume_health_of health data)"
    mount -o remount,ro "$staged" || { fail "cannot remount $staged read-only"; delete_pod health; return; }
    eventually 90 "Pod.status.volumeHealth: Degraded/FilesystemReadOnly" \
        volume_health_is health data "Degraded/FilesystemReadOnly"
    check "the pod cannot write" not in_pod health touch /data/x
    mount -o remount,rw "$staged"
    eventually 90 "repaired: the condition is gone" volume_health_is health data ""
    check "the pod writes again" in_pod health touch /data/x
    delete_pod health

    # The default pool: no volume of it is in use now, so it can be remounted.
    check_eq "the pools are healthy" "" "$(storage_health)"
    mount -o remount,ro "$POOL_DEFAULT" || { fail "cannot remount $POOL_DEFAULT read-only"; return; }
    eventually 90 "CSINode.status.storageHealth: StorageUnreachable/PoolReadOnly" \
        storage_health_has "StorageUnreachable/PoolReadOnly"
    mount -o remount,rw "$POOL_DEFAULT"
    eventually 90 "repaired: the pool's condition is gone" not storage_health_has "PoolReadOnly"
    kc -n "$NS" delete pvc health --wait=true --timeout=120s >/dev/null
}

# volume_health_of POD VOLUME: "STATUS/REASON" of each condition, one a line.
volume_health_of() {
    jp "pod/$1" "{range .status.volumeHealth[?(@.name==\"$2\")].healthConditions[*]}{.status}/{.reason}{\"\\n\"}{end}"
}
volume_health_is() { [ "$(volume_health_of "$1" "$2")" = "$3" ]; }

# storage_health: the driver's "STATUS/REASON" conditions on the node's CSINode.
storage_health() {
    kc get csinode "$NODE" -o jsonpath='{range .status.storageHealth[?(@.name=="example.csi.k8s.io")].healthConditions[*]}{.status}/{.reason}{"\n"}{end}' 2>/dev/null
}
storage_health_has() { storage_health | grep -qx "$1"; }

# The node plugin's driver hangs (stopped with SIGSTOP): its liveness
# endpoint (livenessprobe calling Probe, or the driver's own with the
# builtin-sidecars component) stops answering, the kubelet's liveness probe
# fails and the kubelet restarts the driver's container, which serves again.
scenario_liveness() {
    scenario "a hung node plugin is restarted by its liveness probe"
    local pod
    pod=$(kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node --field-selector "spec.nodeName=$NODE" \
        -o jsonpath='{.items[0].metadata.name}')
    [ -n "$pod" ] || { fail "no node plugin pod"; return; }
    local restarts id pid
    restarts=$(jp "pod/$pod" '{.status.containerStatuses[?(@.name=="csi-driver")].restartCount}' "$DRIVER_NS")
    id=$(jp "pod/$pod" '{.status.containerStatuses[?(@.name=="csi-driver")].containerID}' "$DRIVER_NS")
    pid=$(ctr_ --address "$W/containerd-$NODE/containerd.sock" -n k8s.io tasks ls 2>/dev/null \
        | awk -v id="${id#containerd://}" '$1 == id {print $2}')
    [ -n "$pid" ] || { fail "no process of the driver's container $id"; return; }
    kill -STOP "$pid"
    eventually 180 "the kubelet restarted the hung driver's container" \
        restarted_after "$pod" "$restarts"
    check "it was the liveness probe that failed (event Unhealthy)" liveness_failed "$pod"
    eventually 120 "the node plugin is ready again" \
        kc -n "$DRIVER_NS" wait "pod/$pod" --for=condition=Ready --timeout=5s
    eventually 60 "the kubelet still lists the driver" csinode_has_driver
    pvc alive 64Mi e2e-immediate
    pod alive alive "exec sleep 100000"
    eventually 120 "a volume is staged and published through the restarted driver" pod_running alive
    delete_pod alive
    kc -n "$NS" delete pvc alive --wait=true --timeout=120s >/dev/null
}

# restarted_after POD N: the driver container of POD restarted more than N times.
restarted_after() {
    local now
    now=$(jp "pod/$1" '{.status.containerStatuses[?(@.name=="csi-driver")].restartCount}' "$DRIVER_NS")
    [ -n "$now" ] && [ "$now" -gt "$2" ]
}

liveness_failed() {
    kc -n "$DRIVER_NS" get events --field-selector "involvedObject.name=$1,reason=Unhealthy" \
        -o jsonpath='{.items[*].message}' | grep -q "Liveness probe failed"
}

# Changed block tracking through Kubernetes (the snapshot-metadata
# component): a block volume written in two rounds with a VolumeSnapshot
# after each; a backup client pod, with a ServiceAccount bound to the
# component's client ClusterRole, lists with external-snapshot-metadata's
# lister (its token made for the SnapshotMetadataService's audience, over
# TLS to the sidecar) the allocated blocks of each snapshot and the blocks
# changed between them, which are exactly the ranges written. A token of a
# ServiceAccount without that RBAC is refused by the sidecar.
scenario_snapshot_metadata() {
    scenario "changed block tracking: allocated and changed blocks of two VolumeSnapshots"
    local seg=65536
    pvc cbt 16Mi example-csi-block Block
    block_pod cbt-writer cbt "exec sleep 100000"
    eventually 120 "block pod running" pod_running cbt-writer || return
    # (64 KiB block, count) written: 0 +1, 1 MiB +1, 5 MiB +2; then 1 MiB
    # again and 8 MiB +1
    write_blocks cbt-writer 0:1 16:1 80:2 || { fail "first writes"; return; }
    take_snapshot cbt-a cbt || return
    write_blocks cbt-writer 16:1 128:1 || { fail "second writes"; return; }
    take_snapshot cbt-b cbt || return

    kc -n "$NS" create serviceaccount backup >/dev/null
    kc -n "$NS" create serviceaccount outsider >/dev/null
    kc create clusterrolebinding e2e-backup --clusterrole=example-csi-snapshot-metadata-client \
        --serviceaccount="$NS:backup" >/dev/null
    route_service "$DRIVER_NS" example-csi-snapshot-metadata || { fail "no route to the snapshot metadata service"; return; }
    local ip; ip=$(kc -n "$DRIVER_NS" get service example-csi-snapshot-metadata -o jsonpath='{.spec.clusterIP}')
    apply <<EOF2
apiVersion: v1
kind: Pod
metadata: {name: backup, labels: {e2e: "true"}}
spec:
  serviceAccountName: backup
  terminationGracePeriodSeconds: 1
  # no cluster DNS here: the service's name, as the SnapshotMetadataService says it
  hostAliases: [{ip: "$ip", hostnames: [example-csi-snapshot-metadata.example-csi]}]
  containers:
    - name: client
      image: $LISTER_IMAGE
      imagePullPolicy: Never
      command: ["sh", "-c", "exec sleep 100000"]
EOF2
    eventually 120 "backup client running" pod_running backup || return
    check_eq "allocated blocks of the first snapshot" \
        "0+$seg $((16 * seg))+$seg $((80 * seg))+$((2 * seg))" "$(listed_ranges -s cbt-a)"
    check_eq "allocated blocks of the second snapshot" \
        "0+$seg $((16 * seg))+$seg $((80 * seg))+$((2 * seg)) $((128 * seg))+$seg" "$(listed_ranges -s cbt-b)"
    check_eq "blocks changed from the first snapshot to the second" \
        "$((16 * seg))+$seg $((128 * seg))+$seg" "$(listed_ranges -s cbt-b -p cbt-a)"
    local refused
    # (the lister takes the ServiceAccount's namespace only when told)
    refused=$(in_pod backup snapshot-metadata-lister -n "$NS" -s cbt-a \
        --service-account outsider --service-account-namespace "$NS" 2>&1)
    printf '%s\n' "$refused" >"$W/logs/lister-outsider.log"
    check "the sidecar refuses a token of a ServiceAccount without the RBAC (PermissionDenied)" \
        grep -q PermissionDenied <<<"$refused"
    check_eq "and lists nothing for it" "" "$(awk '$3 ~ /_LENGTH$/' <<<"$refused")"
    delete_pod backup cbt-writer
    kc delete clusterrolebinding e2e-backup >/dev/null
    kc -n "$NS" delete volumesnapshot cbt-a cbt-b --wait=true --timeout=120s >/dev/null
    kc -n "$NS" delete pvc cbt --wait=true --timeout=120s >/dev/null
}

# write_blocks POD SEEK:COUNT...: random 64 KiB blocks written to the pod's
# device at those places (in 64 KiB), flushed.
write_blocks() {
    local pod=$1 w; shift
    for w in "$@"; do
        in_pod "$pod" dd if=/dev/urandom of=/dev/xvda bs=64k seek="${w%%:*}" count="${w##*:}" \
            conv=notrunc,fsync 2>/dev/null || return 1
    done
}

# take_snapshot NAME CLAIM: a VolumeSnapshot of CLAIM, ready to use.
take_snapshot() {
    apply <<EOF2
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: $1}
spec:
  volumeSnapshotClassName: example-csi
  source: {persistentVolumeClaimName: $2}
EOF2
    eventually 120 "snapshot $1 ready to use" field_is "volumesnapshot/$1" '{.status.readyToUse}' true
}

# listed_ranges ARGS...: what the backup pod's lister lists (its table), as
# "OFFSET+SIZE" ranges with adjacent ones joined, in order.
listed_ranges() {
    in_pod backup snapshot-metadata-lister -n "$NS" "$@" 2>"$W/logs/lister.err" \
        | awk '$3 ~ /^(FIXED_LENGTH|VARIABLE_LENGTH)$/ {print $4, $5}' | sort -n \
        | awk 'NR > 1 && $1 == end {end += $2; next}
               NR > 1 {printf "%s%d+%d", sep, start, end - start; sep = " "}
               {start = $1; end = $1 + $2}
               END {if (NR) printf "%s%d+%d", sep, start, end - start; print ""}'
}
