#!/usr/bin/env bash
# The globals set here are read by the e2e/lib/*.sh files it sources.
# shellcheck disable=SC2034
# The end-to-end test: a real Kubernetes of one or two nodes built on this
# machine from upstream sources runs the driver from deploy/, and workloads
# use it as users do. Run as root:
#
#   e2e/run.sh [--flavor central|central-attach|distributed|cluster]... [--helm]
#              [--suite | --suite-only] [--suite-flavor central|cluster]
#              [--single-node] [--builtin-sidecars]
#              [--keep] [--scenario NAME]...
#   e2e/run.sh --bench OUT [--flavor F] [--stress] [--single-node]
#              [-- bench_cluster.py options]
#
# It builds or reuses (e2e/build.sh, cache in ~/.cache/example-csi-e2e) the
# Kubernetes binaries, etcd, containerd and the sidecars deploy/ pins; builds
# the driver's image and the sidecars' images without a registry; starts etcd,
# the control plane (NodeRestriction on), containerd and a kubelet; applies
# each flavor of deploy/ and runs the scenarios of e2e/lib/scenarios.sh against
# it; and tears everything down on success, failure or interrupt, putting back
# what the kubelet and CNI changed on the host. Without --flavor it runs all
# four.
#
# Each flavor is applied as deploy/ ships it, with the stock
# node-driver-registrar and livenessprobe; but in the run of all three flavors
# central-attach runs with the deploy/components/builtin-sidecars component
# (the driver's own kubelet registration and liveness endpoint), and
# --builtin-sidecars applies that component to every flavor.
#
# --helm installs each flavor with the Helm chart (deploy/helm/example-csi)
# instead of kustomize, and checks that `helm uninstall` leaves nothing behind.
#
# The flavors for more than one node run last: distributed, then cluster. A
# second kubelet, node2, starts for them (in a mount namespace of its own,
# with its own pools, containerd and pod subnet): for distributed's per-node
# scenario, and for cluster before it is deployed, so that its controller
# (the router) reaches a node agent on each node. In the cluster flavor every
# scenario runs with volumes on either node, and the two-node scenarios add:
# a claim made on each node; a snapshot restored and a claim cloned for pods
# pinned to the other node, which read byte for byte what was written (the
# data pulled over the mesh); and the network between the two nodes' pod
# subnets cut for 30 s during such a transfer, which then goes on and
# arrives whole; and a claim moved to the other node by scripts/move-claim.sh
# while its workload writes; and last, the second node rebooted: every
# process of it killed at once, every mount and loop device of it gone, its
# containerd's state lost, then booted again, and its pods come back on their
# claims with their data. --single-node leaves the second kubelet out.
#
# The cluster flavor (with kustomize) starts from the distributed flavor,
# with workloads on claims and a snapshot on both nodes, switched to the
# cluster flavor as deploy/README.md says (its claims and snapshots keep
# working through the router), and removed. It then starts from the
# release before this build
# (PREVIOUS_RELEASE in e2e/versions.sh, built from its commit), installed
# from its own deploy/ with workloads and a snapshot on both nodes; this
# build is applied over it, rolled back with `kubectl rollout undo` and
# applied again, and the workloads run on with their data through each step
# (e2e/lib/scenarios_upgrade.sh); its other scenarios then run on the
# upgraded installation.
#
# On the central flavor, the node's own services fail under the driver: the
# kubelet restarted while volumes are staged and published (and a pod deleted
# while it is down, which it finds on its disk), containerd restarted under
# running pods, and the API server down for 30 s mid-provisioning.
#
# --scenario NAME (again for more) runs only the scenarios of those names
# (the function scenario_NAME of e2e/lib/, e.g. network_cut) in each flavor,
# then the check that everything deleted leaves nothing behind: to look
# again at one scenario without the whole run.
#
# RESULT_JSON=FILE writes the counts of checks passed and failed there as
# JSON at the end.
#
# --bench OUT runs no scenario: it deploys the flavor (cluster unless named)
# beside the reference driver (csi-driver-host-path, built from its released
# source, with the same sidecars, a pod on every node) and measures both
# through the Kubernetes API (e2e/lib/bench.sh, e2e/lib/bench_cluster.py):
# claim created to pod Running and where that time goes (the scheduler's
# choice of node, the provisioner's queue, provisioning, binding, the pod's
# placement, the kubelet's mount and the start, each claim's moments as the
# watches deliver them), bursts of claims with pods on one node and spread
# over both (burst2n), a snapshot of written data and its restore, the
# containers' CPU and memory. The flavors of more than one node run on both
# kubelets, node2 started before the flavor is deployed with pools of its
# own and the reference's data directory; --single-node keeps to one (the
# burst2n rows are then reported as not measured). The report is
# OUT/results.md, OUT/results.json and OUT/machine.txt. --stress runs
# `stress-ng --io 2 --cpu 1` beside it all. The options after -- go to
# bench_cluster.py (--rounds, --singles, --bursts, --snapshot-mib, --rows,
# --drivers, --nodes).
#
# --suite also runs Kubernetes' own storage e2e suite, "External Storage"
# (e2e/lib/suite.sh, e2e/testdriver.yaml, skips in e2e/skips.md), against the
# central flavor after the scenarios; --suite-only runs the suite alone.
# --suite-flavor cluster runs it against the cluster flavor instead, on both
# kubelets (unless --single-node): the tests' pods land on either node and
# their volumes are made where they land.
set -euo pipefail
E2E_DIR=$(cd "$(dirname "$0")" && pwd)
SCRIPT_NAME=e2e
# shellcheck source=scripts/preamble.sh
. "$E2E_DIR/../scripts/preamble.sh"
. "$E2E_DIR/versions.sh"
. "$E2E_DIR/lib/hoststate.sh"
. "$E2E_DIR/lib/pki.sh"
. "$E2E_DIR/lib/cluster.sh"
. "$E2E_DIR/lib/images.sh"
. "$E2E_DIR/lib/checks.sh"
. "$E2E_DIR/lib/scenarios.sh"
. "$E2E_DIR/lib/scenarios_move.sh"
. "$E2E_DIR/lib/scenarios_policy.sh"
. "$E2E_DIR/lib/scenarios_chaos.sh"
. "$E2E_DIR/lib/scenarios_upgrade.sh"
. "$E2E_DIR/lib/suite.sh"
. "$E2E_DIR/lib/bench.sh"

FLAVORS=()
ONLY=()
SUITE=0
SUITE_FLAVOR=central
NODE_VOLUME_LIMIT=""
SCENARIOS=1
SINGLE_NODE=0
INSTALLER=kustomize
KEEP=0
TEARDOWN_ONLY=0
BUILTIN_SIDECARS=0
BENCH_OUT=""
BENCH_STRESS=""
BENCH_ARGS=()
BENCH_COMMAND="$0 $*"
while [ $# -gt 0 ]; do
    case $1 in
        --flavor) FLAVORS+=("$2"); shift 2 ;;
        --suite) SUITE=1; shift ;;
        --suite-only) SUITE=1; SCENARIOS=0; shift ;;
        --suite-flavor)
            case $2 in central|cluster) SUITE_FLAVOR=$2 ;;
                *) echo "e2e/run.sh: the suite runs against central or cluster, not $2" >&2; exit 2 ;; esac
            shift 2 ;;
        --single-node) SINGLE_NODE=1; shift ;;
        --helm) INSTALLER=helm; shift ;;
        --keep) KEEP=1; shift ;;
        --scenario)
            declare -F "scenario_$2" >/dev/null || { echo "no scenario named $2" >&2; exit 2; }
            ONLY+=("$2"); shift 2 ;;
        --teardown-only) TEARDOWN_ONLY=1; shift ;;
        --builtin-sidecars) BUILTIN_SIDECARS=1; shift ;;
        --bench) BENCH_OUT=$(realpath -m "$2"); shift 2 ;;
        --stress) BENCH_STRESS="--io 2 --cpu 1"; shift ;;
        --) shift; BENCH_ARGS=("$@"); break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "e2e/run.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
# the flavors that run with the builtin-sidecars component, and those with
# the snapshot-metadata component (central flavors only)
declare -A BUILTIN_IN=()
declare -A SNAPSHOT_METADATA_IN=([central]=1)
if [ -n "$BENCH_OUT" ]; then
    [ ${#FLAVORS[@]} -eq 0 ] && FLAVORS=(cluster)
    SUITE=0
    # bursts of hundreds of pods on one node
    KUBELET_MAX_PODS=600
elif [ -n "$BENCH_STRESS" ] || [ ${#BENCH_ARGS[@]} -gt 0 ]; then
    echo "e2e/run.sh: --stress and -- options go with --bench" >&2; exit 2
fi
if [ ${#FLAVORS[@]} -eq 0 ]; then
    FLAVORS=(central central-attach distributed cluster)
    BUILTIN_IN[central-attach]=1
fi
[ "$SCENARIOS" = 1 ] || FLAVORS=()
for f in "${FLAVORS[@]}"; do
    case $f in central|central-attach|distributed|cluster) ;;
        *) echo "e2e/run.sh: unknown flavor $f" >&2; exit 2 ;; esac
done
# distributed, then cluster, last: the second node stays until the end
ordered=()
for f in "${FLAVORS[@]}"; do [ "$f" = distributed ] || [ "$f" = cluster ] || ordered+=("$f"); done
for f in distributed cluster; do [[ " ${FLAVORS[*]} " == *" $f "* ]] && ordered+=("$f"); done
FLAVORS=("${ordered[@]}")
[ "$(id -u)" = 0 ] || { echo "e2e/run.sh: run as root" >&2; exit 2; }

W=${E2E_WORK:-/tmp/example-csi-e2e}
NODE=localhost
NODES=("$NODE")
[ "$SINGLE_NODE" = 0 ] && [[ " ${FLAVORS[*]} " == *" distributed "* || " ${FLAVORS[*]} " == *" cluster "* ]] \
    && NODES+=(node2)
[ "$SINGLE_NODE" = 0 ] && [ "$SUITE" = 1 ] && [ "$SUITE_FLAVOR" = cluster ] && [ ${#NODES[@]} = 1 ] \
    && NODES+=(node2)
NS=e2e
DRIVER_NS=example-csi
POOL_ROOT=/var/lib/example-csi
POOL_DEFAULT=$POOL_ROOT/pool
POOL_SSD=$POOL_ROOT/ssd
POOL_DIRS=("$POOL_DEFAULT" "$POOL_SSD")
HOST_IP=$(host_ip)
[ -n "$HOST_IP" ] || { echo "e2e/run.sh: no non-loopback IPv4 address on this machine" >&2; exit 2; }
STARTED=$SECONDS

# ------------------------------------------------------------------ setup

install_host_packages() {
    local need=() pair
    for pair in runc:runc iptables:iptables mmdebstrap:mmdebstrap \
                openssl:openssl gcc:gcc getfattr:attr curl:curl /usr/lib/cni/bridge:containernetworking-plugins \
                /bin/busybox:busybox-static mkfs.xfs:xfsprogs; do
        [ -e "${pair%%:*}" ] || command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
    done
    [ -f /usr/lib/x86_64-linux-gnu/libc.a ] || need+=(libc6-dev)
    [ -n "$BENCH_STRESS" ] && ! command -v stress-ng >/dev/null && need+=(stress-ng)
    if [ ${#need[@]} -gt 0 ]; then
        log "installing ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null
    fi
}

teardown() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$KEEP" = 1 ] && [ "$rc" != 130 ]; then
        log "--keep: the cluster stays up (kubectl --kubeconfig $W/admin.kubeconfig); remove it with: $0 --teardown-only"
        return
    fi
    log "tearing down"
    stop_cluster
    # what the node plugin left attached or mounted (after a failure)
    detach_pool_loops
    umount_under /var/lib/kubelet
    detach_pool_loops
    umount_under "$POOL_ROOT"
    umount_under "$W"
    # loop devices of `mount -o loop` go away on their own, a moment later
    local end=$((SECONDS + 20))
    while [ $SECONDS -lt $end ] && [ -n "$(pool_loops_left)" ]; do
        detach_pool_loops
        sleep 0.5
    done
    hoststate_restore "$W/host-before"
    local left
    left=$(hoststate_diff "$W/host-before")
    if [ -n "$left" ]; then
        echo "$left" | sed 's/^/  /' >&2
        log "the machine is NOT as it was (above)"
        [ "$rc" = 0 ] && rc=1
    else
        log "the machine is as it was"
    fi
    # keep the logs of a failed run; the rest goes
    if [ "$rc" = 0 ]; then rm -rf --one-file-system "$W"; else
        find "$W" -mindepth 1 -maxdepth 1 ! -name logs ! -name host-before -exec rm -rf --one-file-system {} + 2>/dev/null
        log "logs kept in $W/logs"
    fi
    exit "$rc"
}

# The loop devices of this run: those of the pools' images, and those backed
# by a file in a pool (the node plugin's volumes, seen from the host by their
# backing device, since their path is the one inside the plugin's container).
pool_loops_left() {
    local pools
    pools=$(losetup -n -O MAJ:MIN,BACK-FILE 2>/dev/null | awk -v w="$W/pools/" 'index($2, w) == 1 {print $1}')
    losetup -n -O NAME,BACK-MAJ:MIN,BACK-FILE 2>/dev/null | awk -v pools=" $(echo $pools) " \
        -v w="$W/" -v r="$POOL_ROOT/" \
        'index(pools, " " $2 " ") || index($3, w) == 1 || index($3, r) == 1 {print $1}'
}

# The loop devices the kubelet attaches over a block volume's device node to
# hold it while a pod maps it (their backing file is on /dev's filesystem). A
# kubelet stopped before it unmaps leaves them, and they keep the volume's own
# loop device, and through it the pool, busy. Only those made during this run.
kubelet_device_loops_left() {
    local dev; dev=$(stat -c '%Hd:%Ld' /dev)
    losetup -n -O NAME,BACK-MAJ:MIN 2>/dev/null | awk -v dev="$dev" '$2 == dev {print $1}' | sort \
        | comm -13 "$W/host-before/loops" -
}

# detach_pool_loops: the kubelet's holds first, then the volumes' loop
# devices, then the pools'.
detach_pool_loops() {
    local l
    for l in $(kubelet_device_loops_left); do losetup -d "$l" 2>/dev/null || true; done
    for l in $(pool_loops_left | sort -r); do losetup -d "$l" 2>/dev/null || true; done
}

make_pools() {
    mkdir -p "$W/pools" "$POOL_ROOT"
    # The node plugin mounts the pools with HostToContainer propagation, which
    # needs a shared mount on the host to receive from (systemd makes /
    # shared; here it is not).
    mount --bind "$POOL_ROOT" "$POOL_ROOT"
    mount --make-rshared "$POOL_ROOT"
    mount_pools "" "$POOL_ROOT"
}

# ------------------------------------------------------------------ deploy

# builtin_sidecars FLAVOR: whether FLAVOR runs with the builtin-sidecars
# component instead of node-driver-registrar and livenessprobe.
builtin_sidecars() { [ "$BUILTIN_SIDECARS" = 1 ] || [ -n "${BUILTIN_IN[$1]:-}" ]; }

# snapshot_metadata FLAVOR: whether FLAVOR runs with external-snapshot-metadata.
snapshot_metadata() { [ -n "${SNAPSHOT_METADATA_IN[$1]:-}" ]; }

# flavor_components FLAVOR: the components of deploy/components FLAVOR runs
# with; inline-ephemeral in each, since the scenarios write a CSI inline
# volume (off unless an operator names its pools).
flavor_components() {
    echo inline-ephemeral
    builtin_sidecars "$1" && echo builtin-sidecars
    snapshot_metadata "$1" && echo snapshot-metadata
    return 0
}

KUSTOMIZE=""
find_kustomize() {
    # the snapshot-metadata component's TLS material (kept, not in git)
    "$E2E_ROOT/deploy/components/snapshot-metadata/make-certs.sh" >/dev/null || die "make-certs.sh failed"
    local gobin; gobin=$(go env GOPATH)/bin
    if [ -x "$gobin/kustomize" ]; then KUSTOMIZE="$gobin/kustomize build --load-restrictor LoadRestrictionsNone"
    else KUSTOMIZE="$BIN_K8S/kubectl kustomize --load-restrictor LoadRestrictionsNone"; fi
}

# render FLAVOR [DEPLOY NAME]: the manifests applied for a flavor, from the
# deploy/ folder DEPLOY (this build's by default), in $W/deploy-NAME.yaml
# (NAME: the flavor by default).
render() {
    local flavor=$1 deploy=${2:-$E2E_ROOT/deploy} name=${3:-$1}
    local dir=$W/kustomize-$name
    mkdir -p "$dir"
    {
        echo "apiVersion: kustomize.config.k8s.io/v1beta1"
        echo "kind: Kustomization"
        # kustomize takes only relative paths
        echo "resources: [$(realpath --relative-to="$dir" "$deploy/overlays/$flavor")]"
        local c components=()
        for c in $(flavor_components "$flavor"); do
            components+=("$(realpath --relative-to="$dir" "$deploy/components/$c")")
        done
        echo "components: [$(IFS=,; echo "${components[*]}")]"
        # NODE_VOLUME_LIMIT: the node plugin's --max-volumes-per-node (the
        # suite's volume limit tests), through its environment variable
        if [ -n "$NODE_VOLUME_LIMIT" ]; then
            cat <<EOF
patches:
  - target: {kind: DaemonSet, name: example-csi-node}
    patch: |
      apiVersion: apps/v1
      kind: DaemonSet
      metadata: {name: example-csi-node}
      spec:
        template:
          spec:
            containers:
              - name: csi-driver
                env: [{name: CSI_MAX_VOLUMES_PER_NODE, value: "$NODE_VOLUME_LIMIT"}]
EOF
        fi
    } >"$dir/kustomization.yaml"
    # shellcheck disable=SC2086
    $KUSTOMIZE "$dir" >"$W/deploy-$name.yaml"
}

HELM_BIN=""
find_helm() {
    HELM_BIN=${HELM:-$(go env GOPATH)/bin/helm}
    if [ ! -x "$HELM_BIN" ]; then
        log "installing helm $HELM_VERSION"
        (cd /tmp && GOFLAGS=-mod=mod go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION") || die "cannot install helm"
    fi
}

helm_() { "$HELM_BIN" --kubeconfig "$W/admin.kubeconfig" "$@"; }

# helm_install FLAVOR: the chart with the values that render what the flavor's
# overlay renders (the classes are the scenarios' own).
helm_install() {
    kc apply -f "$E2E_ROOT/deploy/base/namespace.yaml" >/dev/null
    local args=(--set "flavor=$1" --set-json 'storageClasses=[]' --set-json 'volumeSnapshotClasses=[]')
    args+=(--set-json 'inlineEphemeral.pools=["default"]')
    builtin_sidecars "$1" && args+=(--set builtinSidecars=true)
    snapshot_metadata "$1" && args+=(--set snapshotMetadata.enabled=true)
    [ -n "$NODE_VOLUME_LIMIT" ] && args+=(--set "driver.maxVolumesPerNode=$NODE_VOLUME_LIMIT")
    helm_ install example-csi "$E2E_ROOT/deploy/helm/example-csi" -n "$DRIVER_NS" "${args[@]}" \
        >"$W/logs/helm-install.log" 2>&1 || fail "helm install (logs/helm-install.log)"
}

# Objects of the driver anywhere in the cluster (by name), one a line.
driver_objects() {
    kc get all,serviceaccounts,roles,rolebindings -n "$DRIVER_NS" -o name 2>/dev/null \
        | grep -v -e '^serviceaccount/default$' -e 'configmap/kube-root-ca.crt'
    kc get clusterroles,clusterrolebindings -o name 2>/dev/null | grep example-csi
    kc get csidrivers -o name 2>/dev/null | grep example.csi
}

helm_uninstall() {
    helm_ uninstall example-csi -n "$DRIVER_NS" --wait --timeout 180s >"$W/logs/helm-uninstall.log" 2>&1 \
        || fail "helm uninstall (logs/helm-uninstall.log)"
    eventually 120 "helm uninstall leaves no object of the driver" count_is 0 driver_objects
    kc delete namespace "$DRIVER_NS" --wait=true --timeout=120s >/dev/null 2>&1 || true
}

snapshot_infrastructure() {
    log "snapshot CRDs and snapshot-controller $SNAPSHOTTER_VERSION"
    kc apply -f "$BIN_SNAPSHOTTER/crds/" >/dev/null
    kc wait --for=condition=Established crd --all --timeout=60s >/dev/null
    sed "s/:PINNED\$/:$SNAPSHOTTER_VERSION/" "$E2E_DIR/manifests/snapshot-controller.yaml" | kc apply -f - >/dev/null
    kc -n kube-system rollout status deployment/snapshot-controller --timeout=180s >/dev/null \
        || die "snapshot-controller not ready"
}

# csinode_has_driver [NODE]
csinode_has_driver() {
    kc get csinode "${1:-$NODE}" -o jsonpath='{.spec.drivers[*].name}' 2>/dev/null | grep -qw example.csi.k8s.io
}

deploy_flavor() {
    local flavor=$1
    scenario "deploy $flavor ($INSTALLER)"
    if [ "$INSTALLER" = helm ]; then
        helm_install "$flavor"
    else
        render "$flavor"
        # A custom resource of a CRD applied at once (snapshot-metadata's)
        # waits for its definition: a second apply, as a user would.
        if ! kc apply -f "$W/deploy-$flavor.yaml" >"$W/logs/apply-$flavor.log" 2>&1; then
            kc wait --for=condition=Established crd -l app.kubernetes.io/part-of=example-csi --timeout=60s >/dev/null || true
            local rc=0
            kc apply -f "$W/deploy-$flavor.yaml" >>"$W/logs/apply-$flavor.log" 2>&1 || rc=$?
            check_eq "kubectl apply of the rendered $flavor, again once its CRDs are there (logs/apply-$flavor.log)" 0 "$rc"
        fi
    fi
    local d
    for d in $(kc -n "$DRIVER_NS" get deployment -o name); do
        eventually 180 "$d available" kc -n "$DRIVER_NS" rollout status "$d" --timeout=5s
    done
    for d in $(kc -n "$DRIVER_NS" get daemonset -o name); do
        eventually 180 "$d ready" kc -n "$DRIVER_NS" rollout status "$d" --timeout=5s
    done
    local n
    for n in $(nodes_up); do
        eventually 120 "the kubelet registered the driver (CSINode $n lists it)" csinode_has_driver "$n" || return 1
        check_eq "CSINode topology key" topology.example.csi/node \
            "$(kc get csinode "$n" -o jsonpath='{.spec.drivers[?(@.name=="example.csi.k8s.io")].topologyKeys[0]}')"
        check_eq "the Node carries the topology label (set by the kubelet under NodeRestriction)" "$n" \
            "$(kc get node "$n" -o jsonpath='{.metadata.labels.topology\.example\.csi/node}')"
    done
    check_eq "CSIDriver attachRequired" "$([ "$flavor" = central-attach ] && echo true || echo false)" \
        "$(kc get csidriver example.csi.k8s.io -o jsonpath='{.spec.attachRequired}')"
    if builtin_sidecars "$flavor"; then
        check "the driver registered itself (builtin-sidecars: no registrar container)" \
            count_is 0 node_plugin_containers node-driver-registrar
    else
        check_eq "the node plugin runs the stock registrar deploy/ pins (on every node)" \
            "$SIDECAR_REGISTRY/csi-node-driver-registrar:$REGISTRAR_VERSION" \
            "$(node_plugin_containers node-driver-registrar | sort -u)"
        local pod
        for pod in $(kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node -o name); do
            eventually 60 "the stock registrar of $pod was told by the kubelet that the driver is registered" \
                registrar_says_registered "$pod"
        done
    fi
}

# node_plugin_containers NAME: the image of container NAME in each node plugin pod.
node_plugin_containers() {
    kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node \
        -o jsonpath="{range .items[*]}{.spec.containers[?(@.name==\"$1\")].image}{\"\\n\"}{end}" | grep .
}

# registrar_says_registered POD: the registrar of the node plugin's POD logged
# the kubelet's NotifyRegistrationStatus with the plugin registered (v2.17.0
# prints the status as "plugin_registered:true").
registrar_says_registered() {
    kc -n "$DRIVER_NS" logs "$1" -c node-driver-registrar 2>/dev/null \
        | grep "NotifyRegistrationStatus" | grep -qE "plugin_registered:true|PluginRegistered:true"
}

undeploy_flavor() {
    local flavor=$1
    scenario "remove $flavor ($INSTALLER)"
    if [ "$INSTALLER" = helm ]; then
        helm_uninstall
    else
        kc delete -f "$W/deploy-$flavor.yaml" --wait=true --timeout=180s >/dev/null 2>&1 || true
    fi
    eventually 120 "driver pods gone" count_is 0 kc -n "$DRIVER_NS" get pods -o name
    local n
    for n in $(nodes_up); do
        eventually 60 "the kubelet of $n unregistered the driver" not csinode_has_driver "$n"
    done
    eventually 120 "no CSIStorageCapacity left (collected with its owner)" \
        count_is 0 kc get csistoragecapacity -A -o name
    local kubelet_dirs=(/var/lib/kubelet)
    for n in $(nodes_up | tail -n +2); do kubelet_dirs+=("$W/node-$n/kubelet"); done
    check "no registration socket left" count_is 0 find "${kubelet_dirs[@]/%//plugins_registry}" -name 'example.csi.k8s.io*'
    check "no driver socket left" count_is 0 find "${kubelet_dirs[@]/%//plugins/example.csi.k8s.io}" -type s
}

# wanted NAME: whether scenario NAME runs (every one, unless --scenario named
# others).
wanted() { [ ${#ONLY[@]} -eq 0 ] || [[ " ${ONLY[*]} " == *" $1 "* ]]; }

# run_scenario NAME: scenario_NAME, if wanted.
run_scenario() {
    wanted "$1" || return 0
    "scenario_$1"
}

# upgrade_first FLAVOR: whether FLAVOR starts from the previous release and
# is upgraded to this build (the upgrade scenario: the default deployment,
# installed with kustomize).
upgrade_first() { [ "$1" = cluster ] && [ "$INSTALLER" = kustomize ] && wanted upgrade; }

run_flavor() {
    local flavor=$1
    FLAVOR=$flavor
    CONTROLLER_COMPONENT=controller
    [ "$flavor" = distributed ] && CONTROLLER_COMPONENT=node
    # a failed check is counted, never the end of the run
    set +e
    # the cluster flavor spans every node from the start
    [ "$flavor" = cluster ] && [ ${#NODES[@]} -gt 1 ] && second_node_up
    # an installation of the distributed flavor switched to this one with
    # volumes in use (and removed after); then the previous release
    # installed, upgraded to this build and rolled back and forward with
    # volumes in use; the scenarios below then run on the upgraded
    # installation
    [ "$flavor" = cluster ] && [ "$INSTALLER" = kustomize ] && run_scenario from_distributed
    upgrade_first "$flavor" && scenario_upgrade
    deploy_flavor "$flavor" || { undeploy_flavor "$flavor"; set -e; return; }
    kc get namespace "$NS" >/dev/null 2>&1 || kc create namespace "$NS" >/dev/null
    storage_classes
    SUM=""
    run_scenario provision
    run_scenario capacity
    run_scenario unknown_pool_event
    [ "$flavor" = distributed ] && run_scenario node_pv_policy
    run_scenario snapshot_restore_clone
    run_scenario expand
    run_scenario block
    run_scenario ephemeral
    run_scenario modify
    run_scenario group_snapshot
    run_scenario fsgroup
    run_scenario node_restart
    snapshot_metadata "$flavor" && run_scenario snapshot_metadata
    run_scenario liveness
    run_scenario health
    run_scenario churn
    # the node's services failing under the driver: on one flavor (any named
    # by --scenario)
    if [ "$flavor" = central ] || [ ${#ONLY[@]} -gt 0 ]; then
        run_scenario kubelet_restart
        run_scenario containerd_restart
        run_scenario apiserver_down
    fi
    if [ ${#NODES[@]} -gt 1 ]; then
        case $flavor in
            distributed) run_scenario two_nodes ;;
            cluster)
                run_scenario two_nodes
                run_scenario across_nodes
                run_scenario across_nodes_dir
                run_scenario network_cut
                run_scenario agent_killed
                run_scenario move
                run_scenario node_reboot
                ;;
        esac
    fi
    scenario_cleanup
    kc delete namespace "$NS" --wait=true --timeout=120s >/dev/null 2>&1 || true
    undeploy_flavor "$flavor"
    set -e
}

# ------------------------------------------------------------------ main

mkdir -p "$W"
if [ -f "$W/pids" ]; then
    log "a previous run left $W: tearing it down first"
    ( trap - EXIT; KEEP=0; teardown ) || true
fi
[ "$TEARDOWN_ONLY" = 1 ] && { rm -rf --one-file-system "$W"; log "torn down"; exit 0; }
rm -rf --one-file-system "$W"; mkdir -p "$W/logs"

install_host_packages
log "building (or reusing) Kubernetes $KUBERNETES_VERSION, etcd $ETCD_VERSION, containerd $CONTAINERD_VERSION and the sidecars"
build_args=()
[ "$SUITE" = 1 ] && build_args+=(--suite)
"$E2E_DIR/build.sh" "${build_args[@]}"
[ -n "$BENCH_OUT" ] && "$E2E_DIR/build.sh" hostpath
BIN_K8S=$E2E_CACHE/kubernetes-$KUBERNETES_VERSION
BIN_ETCD=$E2E_CACHE/etcd-$ETCD_VERSION
BIN_CONTAINERD=$E2E_CACHE/containerd-$CONTAINERD_VERSION
BIN_SNAPSHOTTER=$E2E_CACHE/snapshotter-$SNAPSHOTTER_VERSION
declare -A SIDECAR_BINS=(
    [csi-provisioner]=$E2E_CACHE/provisioner-$PROVISIONER_VERSION/csi-provisioner
    [csi-attacher]=$E2E_CACHE/attacher-$ATTACHER_VERSION/csi-attacher
    [csi-resizer]=$E2E_CACHE/resizer-$RESIZER_VERSION/csi-resizer
    [csi-snapshotter]=$BIN_SNAPSHOTTER/csi-snapshotter
    [snapshot-controller]=$BIN_SNAPSHOTTER/snapshot-controller
    [csi-node-driver-registrar]=$E2E_CACHE/registrar-$REGISTRAR_VERSION/csi-node-driver-registrar
    [livenessprobe]=$E2E_CACHE/livenessprobe-$LIVENESSPROBE_VERSION/livenessprobe
    [csi-snapshot-metadata]=$E2E_CACHE/snapshot-metadata-$SNAPSHOT_METADATA_VERSION/csi-snapshot-metadata
)
declare -A SIDECAR_TAGS=([snapshot-controller]=$SNAPSHOTTER_VERSION)
for name in "${!SIDECAR_VERSIONS[@]}"; do SIDECAR_TAGS[$name]=${SIDECAR_VERSIONS[$name]}; done

# the release before this one first: both share the target folder, and the
# build of this one then puts its own binary back in it
if [[ " ${FLAVORS[*]} " == *" cluster "* ]] && upgrade_first cluster && [ -z "$BENCH_OUT" ]; then
    previous_release
fi
log "building the driver (release)"
(cd "$E2E_ROOT" && cargo build --release --quiet --bin csi-driver)
DRIVER_BIN=${CARGO_TARGET_DIR:-$E2E_ROOT/target}/release/csi-driver
"$DRIVER_BIN" --version | grep -qw "$(driver_version)" \
    || die "$DRIVER_BIN is not this build ($(driver_version)): $("$DRIVER_BIN" --version)"
find_kustomize
[ "$INSTALLER" = helm ] && find_helm

hoststate_save "$W/host-before"
trap teardown EXIT
trap 'exit 130' INT TERM

log "building the images"
build_images
[ "$SUITE" = 1 ] && suite_images
[ -n "$BENCH_OUT" ] && bench_images
# the images' folders are in their tarballs now: room on a shared disk
find "$W/images" -mindepth 1 -maxdepth 1 -type d -exec rm -rf --one-file-system {} +
make_pools
[ -n "$BENCH_OUT" ] && bench_pool
start_control_plane
start_node 0 "$NODE"
snapshot_infrastructure
log "cluster up in $((SECONDS - STARTED))s"

for flavor in "${FLAVORS[@]}"; do
    if [ -n "$BENCH_OUT" ]; then bench_flavor "$flavor"; else run_flavor "$flavor"; fi
done

[ "$SUITE" = 1 ] && run_suite

echo
if [ ${#E2E_FAILURES[@]} -gt 0 ]; then
    echo "failed checks:"
    printf '  - %s\n' "${E2E_FAILURES[@]}"
fi
label=$(IFS=,; echo "${FLAVORS[*]}")
[ "$SUITE" = 1 ] && label="${label:+$label,}suite"
echo "e2e ($label; Kubernetes $KUBERNETES_VERSION; $((SECONDS - STARTED))s): $E2E_PASSED passed, $E2E_FAILED failed"
# The same counts for a program to read (scripts/test-all.sh): RESULT_JSON=FILE.
if [ -n "${RESULT_JSON:-}" ]; then
    printf '{"passed": %d, "failed": %d, "seconds": %d}\n' \
        "$E2E_PASSED" "$E2E_FAILED" "$((SECONDS - STARTED))" >"$RESULT_JSON"
fi
[ "$E2E_FAILED" = 0 ]
