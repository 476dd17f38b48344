# shellcheck shell=bash
# Moving a claim to another node with scripts/move-claim.sh, as an operator
# does, while its workload writes: the cluster flavor on two nodes.
#
# Needs: kc, NS, NODES (two), BUSYBOX_IMAGE, E2E_ROOT, BIN_K8S, W.

# A writer: 32 MiB of random data with its checksum once, then a counter
# appended and synced five times a second, for as long as the pod runs; told
# to stop, it writes "stop N" (N its last number) and syncs. Started again,
# it goes on from its last number.
MOVE_WRITER='trap "echo stop \$i >> /data/count; sync; exit 0" TERM; [ -s /data/file.sum ] || { dd if=/dev/urandom of=/data/file bs=1M count=32 2>/dev/null && sha256sum /data/file | cut -c1-64 > /data/file.sum; }; i=$(grep -v stop /data/count 2>/dev/null | tail -n1); i=${i:-0}; while true; do i=$((i+1)); echo $i >> /data/count; sync; sleep 0.2 & wait $!; done'

# The counter file as it must be after one stop: 1, 2, ... N, "stop N",
# N+1, ... (nothing lost before the stop, nothing counted twice after).
# shellcheck disable=SC2016
COUNT_WHOLE='awk '"'"'BEGIN {e = 1} /^stop/ {if ($2 != e - 1) exit 1; s++; next} {if ($1 != e) exit 1; e++} END {exit !(s == 1 && e > 10)}'"'"' /data/count'

# mover_running: a pod of the writer Deployment runs.
mover_running() { [ -n "$(mover_pod)" ]; }

# mover_pod: the name of the writer Deployment's running pod.
mover_pod() {
    kc -n "$NS" get pod -l app=mover --field-selector status.phase=Running \
        -o jsonpath='{.items[0].metadata.name}' 2>/dev/null
}

scenario_move() {
    scenario "a claim moved to the other node while its workload writes (scripts/move-claim.sh)"
    [ ${#NODES[@]} -ge 2 ] || { echo "  NOT RUN  one node only"; return; }
    pvc moved 1Gi e2e-xfs
    apply <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: mover, labels: {e2e: "true"}}
spec:
  replicas: 1
  selector: {matchLabels: {app: mover}}
  template:
    metadata: {labels: {app: mover, e2e: "true"}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
        - name: app
          image: $BUSYBOX_IMAGE
          imagePullPolicy: Never
          command: ["sh", "-c", '$MOVE_WRITER']
          volumeMounts: [{name: data, mountPath: /data}]
      volumes:
        - name: data
          persistentVolumeClaim: {claimName: moved}
EOF
    eventually 120 "the writer runs" mover_running || return
    local pod from to
    pod=$(mover_pod)
    eventually 60 "it wrote its data" in_pod "$pod" test -s /data/file.sum || return
    from=$(node_of_pvc moved)
    if [ "$from" = "${NODES[0]}" ]; then to=${NODES[1]}; else to=${NODES[0]}; fi
    local sum; sum=$(in_pod "$pod" cat /data/file.sum)
    sleep 3
    local log=$W/move-claim.log start=$SECONDS
    if KUBECTL="$BIN_K8S/kubectl" KUBECONFIG="$W/admin.kubeconfig" \
        "$E2E_ROOT/scripts/move-claim.sh" -n "$NS" moved "$to" --workload deployment/mover --timeout 600 \
        >"$log" 2>&1; then
        pass "move-claim.sh moved the claim from $from to $to ($((SECONDS - start))s)"
    else
        fail "move-claim.sh failed: $(tail -n 3 "$log" | tr '\n' ' ')"
        return
    fi
    check_eq "the claim's volume is on $to" "$to" "$(node_of_pvc moved)"
    eventually 180 "the writer runs again" mover_running || return
    pod=$(mover_pod)
    check_eq "its pod is on $to" "$to" "$(jp "pod/$pod" '{.spec.nodeName}')"
    check_sum "it reads the data written on $from" "$sum" "$(in_pod "$pod" sha256sum /data/file | cut -c1-64)"
    # The counter: every number up to the stop, once each, the stop, then
    # the numbers written on the new node.
    sleep 2
    check "the counter lost nothing before the stop and goes on after it" in_pod "$pod" sh -c "$COUNT_WHOLE"
    local downtime
    downtime=$(sed -n 's/^\([0-9:]*\) move-claim: stopping.*/\1/p; s/^\([0-9:]*\) move-claim: starting.*/\1/p' "$log" | tr '\n' ' ')
    echo "  info  stop and start of the workload: $downtime(move-claim.sh log: $log)"
    check "the pre-copy's claim and snapshot are gone" all_of 'gone pvc/moved-move-pre' 'gone volumesnapshot/moved-move-pre'
    kc -n "$NS" delete deployment mover --wait=true --timeout=120s >/dev/null 2>&1
    kc -n "$NS" wait --for=delete pod -l app=mover --timeout=120s >/dev/null 2>&1 || true
    kc -n "$NS" delete pvc moved --wait=true --timeout=120s >/dev/null
}
