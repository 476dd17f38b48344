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
    check_eq "PV pinned to the node by our topology key" "$NODE" \
        "$(kc get pv "$pv" -o jsonpath='{.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[?(@.key=="topology.example.csi/node")].values[0]}')"
    check_eq "PV capacity" 10Gi "$(kc get pv "$pv" -o jsonpath='{.spec.capacity.storage}')"
    local vol file; vol=$(volume_of data)
    file=$(pool_file_of "$vol")
    check "the volume's image is in the ssd pool" test -f "$POOL_SSD/volumes/$vol.img"
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
    check "the snapshot is a file in the pool ($handle)" test -e "$POOL_SSD/snapshots/$handle.img"
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
    a=$(volume_of restored); b=$(volume_of clone)
    check "restore and clone are volumes of their own in the pool" \
        test -f "$POOL_SSD/volumes/$a.img" -a -f "$POOL_SSD/volumes/$b.img" -a "$a" != "$b"
    delete_pod reader-restored reader-clone
    kc -n "$NS" delete pvc restored clone --wait=true --timeout=120s >/dev/null
    eventually 60 "restore and clone deleted from the pool" \
        test ! -e "$POOL_SSD/volumes/$a.img" -a ! -e "$POOL_SSD/volumes/$b.img"
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
    PVC_LABELS='group: pair' pvc g1 1Gi e2e-immediate
    PVC_LABELS='group: pair' pvc g2 1Gi e2e-immediate
    eventually 60 "both claims bound" all_of "pvc_bound g1" "pvc_bound g2" || return
    apply <<EOF
apiVersion: groupsnapshot.storage.k8s.io/v1
kind: VolumeGroupSnapshot
metadata: {name: pair}
spec:
  volumeGroupSnapshotClassName: example-csi
  source: {selector: {matchLabels: {group: pair}}}
EOF
    eventually 120 "group snapshot ready" field_is volumegroupsnapshot/pair '{.status.readyToUse}' true || return
    local members
    members=$(kc -n "$NS" get volumesnapshot -o json | python3 -c '
import json, sys
items = json.load(sys.stdin)["items"]
print(sum(1 for i in items if any(o.get("kind") == "VolumeGroupSnapshot" for o in i["metadata"].get("ownerReferences", []))))')
    check_eq "one member snapshot per claim" 2 "$members"
    kc -n "$NS" delete volumegroupsnapshot pair --wait=true --timeout=120s >/dev/null
    eventually 60 "member snapshots gone with the group" count_is 1 kc -n "$NS" get volumesnapshot -o name
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
    local old; old=$(node_plugin_pods)
    kc -n "$DRIVER_NS" delete pod -l app.kubernetes.io/component=node --wait=true --timeout=120s >/dev/null
    eventually 180 "a new node plugin is ready" node_plugin_replaced "$old" || return
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

# Two nodes, each with its own pools and node plugin (the distributed flavor):
# the second kubelet starts now, the driver registers there with its own
# topology, the provisioner publishes capacity per node, claims are made in
# the pool of the node their pod is on, and a pod that names no node goes to
# where its volume is.
scenario_two_nodes() {
    scenario "two nodes: per-node provisioning, capacity and scheduling"
    local second=${NODES[1]}
    if ! kc get node "$second" >/dev/null 2>&1; then
        start_node 1 "$second"
        POOL_DIRS+=("$W/node-$second/example-csi/pool" "$W/node-$second/example-csi/ssd")
    fi
    eventually 180 "the node plugin runs on both nodes" node_plugin_on_nodes 2 || return
    eventually 120 "the kubelet of $second registered the driver" csinode_has_driver "$second" || return
    check_eq "$second carries its own topology label" "$second" \
        "$(kc get node "$second" -o jsonpath='{.metadata.labels.topology\.example\.csi/node}')"
    local n
    for n in "${NODES[@]}"; do
        eventually 120 "CSIStorageCapacity of the ssd class for $n" capacity_for example-csi "$n"
    done
    # e2e-xfs provisions in the ssd pool
    local pool0=$POOL_SSD pool1=$W/node-$second/example-csi/ssd i
    local -a pools=("$pool0" "$pool1")
    for i in 0 1; do
        n=${NODES[$i]}
        pvc "on-$i" 1Gi e2e-xfs
        pod "on-$i" "on-$i" "$WRITE_DATA" "  nodeSelector: {kubernetes.io/hostname: $n}"
    done
    for i in 0 1; do
        n=${NODES[$i]}
        eventually 120 "pod pinned to $n running" pod_running "on-$i" || return
        eventually 60 "pod on $n wrote its data" in_pod "on-$i" test -s /data/file.sum
        local pv vol; pv=$(jp "pvc/on-$i" '{.spec.volumeName}'); vol=$(volume_of "on-$i")
        check_eq "the PV of the claim used on $n is pinned to $n" "$n" \
            "$(kc get pv "$pv" -o jsonpath='{.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[?(@.key=="topology.example.csi/node")].values[0]}')"
        check "its image is in the pool of $n" test -f "${pools[$i]}/volumes/$vol.img"
        check "and not in the other node's pool" not test -e "${pools[$((1 - i))]}/volumes/$vol.img"
    done
    local -a sums=("$(in_pod on-0 cat /data/file.sum)" "$(in_pod on-1 cat /data/file.sum)")
    check "both pods' checksums read (${sums[0]:0:8}.., ${sums[1]:0:8}..)" is_sum "${sums[0]}" "${sums[1]}"
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
    local images; images="${pools[0]}/volumes/$(volume_of on-0).img ${pools[1]}/volumes/$(volume_of on-1).img"
    delete_pod again-0 again-1
    kc -n "$NS" delete pvc on-0 on-1 --wait=true --timeout=120s >/dev/null
    # shellcheck disable=SC2086
    eventually 60 "both volumes deleted from their node's pool" not ls $images
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
    scenario "capacity: CSIStorageCapacity for the node, and a claim too large for it"
    eventually 120 "CSIStorageCapacity of the ssd class for $NODE" capacity_for example-csi "$NODE" || return
    local cap max owner free want_owner
    read -r cap max owner <<<"$(capacity_of example-csi "$NODE")"
    free=$(df -B1 --output=avail "$POOL_SSD" | tail -1 | tr -d ' ')
    check "published capacity ($cap) is the ssd pool's free space ($free)" near "$cap" "$free"
    check_eq "maximum volume size is the capacity" "$cap" "$max"
    want_owner=Deployment/example-csi-controller
    [ "$FLAVOR" = distributed ] && want_owner="Pod/$(kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node \
        --field-selector "spec.nodeName=$NODE" -o jsonpath='{.items[0].metadata.name}')"
    check_eq "the capacity object's owner" "$want_owner" "$owner"
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
    before=$(find "$POOL_DEFAULT/volumes" -mindepth 1 -maxdepth 1 | sort)
    churn_claims 1 10
    kc -n "$DRIVER_NS" delete pod -l app.kubernetes.io/component="$CONTROLLER_COMPONENT" --wait=false >/dev/null
    churn_claims 11 20
    eventually 300 "all 20 claims bound" bound_count_is churn=yes 20
    local pvs
    pvs=$(kc get pv -o jsonpath='{range .items[*]}{.spec.claimRef.name}{"\n"}{end}' | grep -c '^churn-')
    check_eq "one PV per claim" 20 "$pvs"
    local made
    made=$(comm -13 <(echo "$before") <(find "$POOL_DEFAULT/volumes" -mindepth 1 -maxdepth 1 | sort) | grep -c .)
    check_eq "one new image per claim in the pool, none leaked" 20 "$made"
    kc -n "$NS" delete pvc -l churn=yes --wait=true --timeout=180s >/dev/null
    eventually 120 "the 20 volumes deleted from the pool, nothing else" \
        same_list "$before" find "$POOL_DEFAULT/volumes" -mindepth 1 -maxdepth 1
}

# churn_claims FIRST LAST: claims churn-FIRST..churn-LAST in one request.
churn_claims() {
    local i
    for i in $(seq "$1" "$2"); do
        cat <<EOF
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: churn-$i, labels: {e2e: "true", churn: "yes"}}
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
    # the kubelet unstages after the pod is gone, on its own schedule
    eventually 60 "no loop device backed by a pool file" count_is 0 pool_loops \
        || losetup -n -O NAME,BACK-MAJ:MIN,BACK-FILE | sed 's/^/        /'
    eventually 60 "no mount of a volume under the kubelet's directory" count_is 0 volume_mounts
    eventually 60 "no staging directory left" count_is 0 find /var/lib/kubelet/plugins/kubernetes.io/csi \
        "$W"/node-*/kubelet/plugins/kubernetes.io/csi -mindepth 2 -maxdepth 4 -type d -name globalmount
}
