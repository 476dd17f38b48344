#!/usr/bin/env bash
# Moves a claim's data to another node, with the workload stopped only for
# the last delta (the cluster flavor: the router pulls a restore's data to
# the node it is made on; docs/multi-node.md).
#
#   scripts/move-claim.sh -n NAMESPACE CLAIM NODE [--workload KIND/NAME]
#                         [--snapshot-class CLASS] [--timeout SECONDS] [--keep]
#
#   1. pre-copy: a VolumeSnapshot of CLAIM and a claim from it on NODE,
#      made while the workload runs; waits until its data is on NODE
#      (the claim's Event TransferDone);
#   2. stops the workload (--workload: a Deployment or StatefulSet scaled
#      to 0, its replicas remembered in an annotation), then a second
#      snapshot: only what changed since the pre-copy travels;
#   3. CLAIM itself is made again on NODE from that snapshot (same name,
#      class, size, modes: the workload needs no change), and the workload
#      is scaled back; its pods start on NODE once the data is whole;
#   4. removes the pre-copy's claim and snapshot; the second snapshot stays
#      until the new claim's data is whole, then goes too (--keep keeps it).
#
# The old volume is deleted with the old claim (when its PersistentVolume's
# reclaim policy is Delete) only after the second snapshot is ready: that
# snapshot holds the data until the new claim's transfer is done. Each step
# says what it does; an interrupted move is run again with the same
# arguments and goes on from the objects it finds.
set -euo pipefail
# shellcheck source=scripts/preamble.sh
. "$(dirname "$0")/preamble.sh"

ns=""
workload=""
snapclass=""
timeout=1800
keep=0
args=()
while [ $# -gt 0 ]; do
    case $1 in
        -n|--namespace) ns=$2; shift 2 ;;
        --workload) workload=$2; shift 2 ;;
        --snapshot-class) snapclass=$2; shift 2 ;;
        --timeout) timeout=$2; shift 2 ;;
        --keep) keep=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*) echo "move-claim.sh: unknown option $1" >&2; exit 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
[ ${#args[@]} -eq 2 ] && [ -n "$ns" ] || {
    echo "usage: move-claim.sh -n NAMESPACE CLAIM NODE [--workload KIND/NAME] [--snapshot-class CLASS] [--timeout S] [--keep]" >&2
    exit 2
}
claim=${args[0]}
node=${args[1]}
KUBECTL=${KUBECTL:-kubectl}
kc() { "$KUBECTL" -n "$ns" "$@"; }
say() { printf '%s move-claim: %s\n' "$(date +%H:%M:%S)" "$*"; }

pre_snap="$claim-move-pre"
pre_claim="$claim-move-pre"
final_snap="$claim-move-final"
annotation=example.csi.k8s.io/move-replicas

# ---------------------------------------------------------------- checks
"$KUBECTL" get node "$node" >/dev/null || die "no node $node"
spec_of() { kc get pvc "$claim" -o "jsonpath=$1"; }
if kc get pvc "$claim" >/dev/null 2>&1; then
    sc=$(spec_of '{.spec.storageClassName}')
    size=$(spec_of '{.status.capacity.storage}')
    [ -n "$size" ] || size=$(spec_of '{.spec.resources.requests.storage}')
    modes=$(spec_of '{.spec.accessModes}')
    vmode=$(spec_of '{.spec.volumeMode}')
    on=$(spec_of '{.metadata.annotations.volume\.kubernetes\.io/selected-node}')
elif kc get volumesnapshot "$final_snap" >/dev/null 2>&1; then
    # A move stopped after the old claim went: its snapshot remembers.
    sc=$(kc get volumesnapshot "$final_snap" -o 'jsonpath={.metadata.annotations.example\.csi\.k8s\.io/move-class}')
    size=$(kc get volumesnapshot "$final_snap" -o 'jsonpath={.metadata.annotations.example\.csi\.k8s\.io/move-size}')
    modes=$(kc get volumesnapshot "$final_snap" -o 'jsonpath={.metadata.annotations.example\.csi\.k8s\.io/move-modes}')
    vmode=$(kc get volumesnapshot "$final_snap" -o 'jsonpath={.metadata.annotations.example\.csi\.k8s\.io/move-volume-mode}')
    on=""
else
    die "no claim $claim in namespace $ns"
fi
[ -n "$sc" ] && [ -n "$size" ] || die "claim $claim: no storage class or size"
[ "$on" = "$node" ] && { say "$claim is on $node already"; exit 0; }
if [ -z "$snapclass" ]; then
    driver=$("$KUBECTL" get storageclass "$sc" -o 'jsonpath={.provisioner}')
    snapclass=$("$KUBECTL" get volumesnapshotclass -o json | python3 -c '
import json, sys
driver = sys.argv[1]
items = [c for c in json.load(sys.stdin)["items"] if c.get("driver") == driver]
default = [c for c in items if c["metadata"].get("annotations", {}).get(
    "snapshot.storage.kubernetes.io/is-default-class") == "true"]
print((default or items or [{"metadata": {"name": ""}}])[0]["metadata"]["name"])' "$driver")
    [ -n "$snapclass" ] || die "no VolumeSnapshotClass of $driver: name one with --snapshot-class"
fi

# --------------------------------------------------------------- helpers
snapshot() { # NAME: a ready VolumeSnapshot of the claim
    local name=$1
    if ! kc get volumesnapshot "$name" >/dev/null 2>&1; then
        say "snapshot $name of $claim"
        kc apply -f - >/dev/null <<YAML
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata:
  name: $name
  annotations:
    example.csi.k8s.io/move-class: "$sc"
    example.csi.k8s.io/move-size: "$size"
    example.csi.k8s.io/move-modes: '$modes'
    example.csi.k8s.io/move-volume-mode: "$vmode"
spec:
  volumeSnapshotClassName: $snapclass
  source:
    persistentVolumeClaimName: $claim
YAML
    fi
    kc wait --for=jsonpath='{.status.readyToUse}'=true "volumesnapshot/$name" --timeout="${timeout}s" >/dev/null \
        || die "snapshot $name is not ready"
}

restore() { # CLAIM SNAPSHOT: a claim made on the node from the snapshot
    local name=$1 snap=$2 mode_list
    kc get pvc "$name" >/dev/null 2>&1 && return 0
    mode_list=$(python3 -c 'import json, sys; print(", ".join(json.loads(sys.argv[1])))' "$modes")
    say "claim $name from $snap on $node"
    kc apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: $name
  annotations:
    # provisioned at once on the node, without waiting for a pod
    volume.kubernetes.io/selected-node: $node
spec:
  storageClassName: $sc
  accessModes: [$mode_list]
  volumeMode: ${vmode:-Filesystem}
  resources:
    requests:
      storage: $size
  dataSource:
    apiGroup: snapshot.storage.k8s.io
    kind: VolumeSnapshot
    name: $snap
YAML
}

arrived() { # CLAIM: its data is whole on the node (the router's Event)
    local name=$1 end=$((SECONDS + timeout))
    kc wait --for=jsonpath='{.status.phase}'=Bound "pvc/$name" --timeout="${timeout}s" >/dev/null \
        || die "claim $name is not bound"
    while [ $SECONDS -lt $end ]; do
        kc get events -o name --field-selector \
            "involvedObject.kind=PersistentVolumeClaim,involvedObject.name=$name,reason=TransferDone" \
            2>/dev/null | grep -q . && return 0
        sleep 2
    done
    die "the data of claim $name did not arrive on $node within ${timeout}s"
}

# ------------------------------------------------------------------ move
# 1. pre-copy while the workload runs (skipped when the claim is gone: a
#    move that stopped after step 3 began)
if kc get pvc "$claim" >/dev/null 2>&1 && ! kc get volumesnapshot "$final_snap" >/dev/null 2>&1; then
    snapshot "$pre_snap"
    restore "$pre_claim" "$pre_snap"
    arrived "$pre_claim"
    say "pre-copy on $node done"
fi

# 2. stop the workload, snapshot what it wrote last
if [ -n "$workload" ]; then
    replicas=$(kc get "$workload" -o "jsonpath={.metadata.annotations.example\.csi\.k8s\.io/move-replicas}")
    if [ -z "$replicas" ]; then
        replicas=$(kc get "$workload" -o 'jsonpath={.spec.replicas}')
        kc annotate "$workload" "$annotation=$replicas" --overwrite >/dev/null
    fi
    say "stopping $workload (was $replicas replicas)"
    kc scale "$workload" --replicas=0 >/dev/null
    sel=$(kc get "$workload" -o json | python3 -c '
import json, sys
m = json.load(sys.stdin)["spec"]["selector"].get("matchLabels", {})
print(",".join(f"{k}={v}" for k, v in m.items()))')
    kc wait --for=delete pod -l "$sel" --timeout="${timeout}s" >/dev/null 2>&1 || true
    [ -z "$(kc get pods -l "$sel" -o name)" ] || die "the pods of $workload did not stop"
fi
if kc get pvc "$claim" >/dev/null 2>&1; then
    snapshot "$final_snap"
    # 3. the claim again, on the node
    say "replacing claim $claim"
    kc delete pvc "$claim" --wait=true --timeout="${timeout}s" >/dev/null
fi
restore "$claim" "$final_snap"
if [ -n "$workload" ]; then
    say "starting $workload again ($replicas replicas)"
    kc scale "$workload" --replicas="$replicas" >/dev/null
    kc annotate "$workload" "$annotation-" >/dev/null
fi
arrived "$claim"
say "$claim is whole on $node"

# 4. clean up
kc delete pvc "$pre_claim" --ignore-not-found --wait=false >/dev/null
kc delete volumesnapshot "$pre_snap" --ignore-not-found --wait=false >/dev/null
[ "$keep" = 1 ] || kc delete volumesnapshot "$final_snap" --ignore-not-found --wait=false >/dev/null
say "done"
