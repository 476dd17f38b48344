# shellcheck shell=bash
# Scenarios of what deploy/ lets, and does not let, the parts of the driver
# and its users do through the Kubernetes API, and of what a user is told
# of a mistake in a StorageClass.
#
# Needs: kc, NS, DRIVER_NS, NODE, W, BIN_K8S.

# The distributed flavor's node pods hold a ServiceAccount token that may
# create PersistentVolumes (their external-provisioner makes the PVs of
# their node's volumes). The ValidatingAdmissionPolicy shipped with the
# flavor lets a token bound to a node pod create only this driver's PVs,
# pinned to the node of that pod: a forged hostPath PV, another driver's PV
# and a PV for another node are refused, and the driver's own provisioning
# still works.
scenario_node_pv_policy() {
    scenario "node token: PersistentVolumes only of this driver, on the token's own node"
    check "the policy and its binding are installed" \
        kc get validatingadmissionpolicy/example-csi-node-persistentvolumes \
        validatingadmissionpolicybinding/example-csi-node-persistentvolumes
    local pod
    pod=$(kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node \
        --field-selector "spec.nodeName=$NODE" -o jsonpath='{.items[0].metadata.name}')
    [ -n "$pod" ] || { fail "no node pod on $NODE"; return; }
    # A token as the kubelet gives the node pod: bound to it, so it names its node.
    local token cfg=$W/node-token.kubeconfig
    token=$(kc -n "$DRIVER_NS" create token example-csi-node \
        --bound-object-kind Pod --bound-object-name "$pod" --duration 10m) \
        || { fail "no token for the node pod's ServiceAccount"; return; }
    # Only the token: the admin kubeconfig's client certificate would win.
    cat > "$cfg" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: e2e
    cluster:
      server: $(kc config view --raw -o jsonpath='{.clusters[0].cluster.server}')
      certificate-authority: $(kc config view --raw -o jsonpath='{.clusters[0].cluster.certificate-authority}')
contexts:
  - name: node
    context: {cluster: e2e, user: node}
current-context: node
users:
  - name: node
    user: {token: $token}
EOF
    check_eq "the token is the node pods' ServiceAccount" \
        system:serviceaccount:$DRIVER_NS:example-csi-node "$(as_node_pod auth whoami -o jsonpath='{.status.userInfo.username}')"
    check_eq "the token names the pod's node" "$NODE" "$(as_node_pod auth whoami -o json | python3 -c '
import json, sys
print(json.load(sys.stdin)["status"]["userInfo"].get("extra", {}).get("authentication.kubernetes.io/node-name", [""])[0])')"
    local refused
    refused=$(forged_pv hostpath "hostPath: {path: /, type: Directory}" "$NODE" | as_node_pod create --dry-run=server -f - 2>&1)
    check "a hostPath PV for its own node is refused ($(policy_said "$refused"))" refused_by_policy "$refused"
    refused=$(forged_pv other-node "csi: {driver: example.csi.k8s.io, volumeHandle: forged}" node-elsewhere \
        | as_node_pod create --dry-run=server -f - 2>&1)
    check "a PV of this driver for another node is refused ($(policy_said "$refused"))" refused_by_policy "$refused"
    refused=$(forged_pv other-driver "csi: {driver: hostpath.csi.k8s.io, volumeHandle: forged}" "$NODE" \
        | as_node_pod create --dry-run=server -f - 2>&1)
    check "a PV of another CSI driver is refused ($(policy_said "$refused"))" refused_by_policy "$refused"
    refused=$(forged_pv no-affinity "csi: {driver: example.csi.k8s.io, volumeHandle: forged}" "" \
        | as_node_pod create --dry-run=server -f - 2>&1)
    check "a PV of this driver without node affinity is refused ($(policy_said "$refused"))" refused_by_policy "$refused"
    local own
    own=$(forged_pv own "csi: {driver: example.csi.k8s.io, volumeHandle: e2e-own}" "$NODE" \
        | as_node_pod create --dry-run=server -f - 2>&1)
    check "a PV of this driver pinned to its own node is let through (dry run: $own)" \
        dry_run_created "$own"
    check "nothing was made" not forged_pv_exists
    # The driver's own provisioning, through the node pod's own token.
    pvc policy-own 1Gi e2e-xfs
    pod policy-own policy-own "exec sleep 100000" "  nodeSelector: {kubernetes.io/hostname: $NODE}"
    eventually 120 "a claim of the node is provisioned by its node pod" pvc_bound policy-own
    local pv; pv=$(jp pvc/policy-own '{.spec.volumeName}')
    check_eq "its PV is pinned to the node" "$NODE" \
        "$(kc get pv "$pv" -o jsonpath='{.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[?(@.key=="topology.example.csi/node")].values[0]}')"
    delete_pod policy-own
    kc -n "$NS" delete pvc policy-own --wait=true --timeout=120s >/dev/null 2>&1
    eventually 60 "and it is deleted with its claim" not kc get pv "$pv"
    rm -f "$cfg"
}

# as_node_pod KUBECTL-ARGS...: kubectl with the node pod's token alone.
as_node_pod() { "$BIN_K8S/kubectl" --kubeconfig "$W/node-token.kubeconfig" "$@"; }

# forged_pv NAME SOURCE NODE: a PersistentVolume NAME of volume SOURCE,
# pinned to NODE by the driver's topology key (none when NODE is empty).
forged_pv() {
    local affinity=""
    [ -n "$3" ] && affinity="  nodeAffinity: {required: {nodeSelectorTerms: [{matchExpressions: [{key: topology.example.csi/node, operator: In, values: [$3]}]}]}}"
    cat <<EOF
apiVersion: v1
kind: PersistentVolume
metadata: {name: e2e-forged-$1}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  $2
$affinity
EOF
}

# dry_run_created OUTPUT: kubectl's OUTPUT says a server dry run created it.
dry_run_created() { grep -q 'created (server dry run)' <<<"$1"; }

forged_pv_exists() { kc get pv -o name | grep -q e2e-forged; }

# refused_by_policy OUTPUT: kubectl's OUTPUT is a refusal by the policy.
refused_by_policy() { grep -q 'ValidatingAdmissionPolicy .*example-csi-node-persistentvolumes.* denied request' <<<"$1"; }

# policy_said OUTPUT: the policy's message in kubectl's OUTPUT, or OUTPUT.
policy_said() { sed -n 's/.*denied request: //p' <<<"$1" | head -1 | cut -c1-120; }

# A StorageClass naming a pool no node has: its claim is not left Pending
# with only "did not have enough free storage". The scheduler places its
# pod, CreateVolume refuses the class, and the claim carries the refusal,
# which names the pool and the pools the node has.
scenario_unknown_pool_event() {
    scenario "a class naming an unknown pool: the claim says why"
    kc apply -f - >/dev/null <<EOF
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: e2e-unknown-pool}
provisioner: example.csi.k8s.io
parameters: {type: nvme-does-not-exist}
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
EOF
    # Before the pod: the scheduler would refuse it on a node whose capacity
    # for the new class is not published yet, and that refusal stays on the
    # pod until it is scheduled again.
    local n
    for n in $(nodes_up); do
        eventually 120 "the class's capacity for $n is published, not zero" capacity_for e2e-unknown-pool "$n"
    done
    pvc unknown-pool 1Gi e2e-unknown-pool
    pod unknown-pool unknown-pool "exec sleep 100000"
    eventually 180 "the claim gets a ProvisioningFailed Event naming the pool and the node's pools" \
        provisioning_failed_says unknown-pool 'unknown pool "nvme-does-not-exist": node .* has the pools'
    check "the pod is not refused for lack of storage on every node" not refused_for_storage_everywhere unknown-pool
    check_eq "the claim stays Pending" Pending "$(jp pvc/unknown-pool '{.status.phase}')"
    delete_pod unknown-pool
    kc -n "$NS" delete pvc unknown-pool --wait=true --timeout=60s >/dev/null 2>&1
    kc delete storageclass e2e-unknown-pool >/dev/null 2>&1
}

# refused_for_storage_everywhere POD: the scheduler found no node with the
# storage POD's claims ask for.
refused_for_storage_everywhere() {
    jp "pod/$1" '{.status.conditions[?(@.type=="PodScheduled")].reason} {.status.conditions[?(@.type=="PodScheduled")].message}' \
        | grep -qE '^Unschedulable 0/([0-9]+) nodes are available: \1 node\(s\) did not have enough free storage'
}

# provisioning_failed_says CLAIM REGEX: a ProvisioningFailed Event of CLAIM
# whose message matches REGEX.
provisioning_failed_says() {
    kc -n "$NS" get events --field-selector "involvedObject.kind=PersistentVolumeClaim,involvedObject.name=$1,reason=ProvisioningFailed" \
        -o jsonpath='{range .items[*]}{.message}{"\n"}{end}' | grep -qE "$2"
}
