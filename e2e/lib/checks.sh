# shellcheck shell=bash
# Assertions and waits of the end-to-end scenarios. Each check prints one line
# and is counted; the run ends with "e2e: N passed, M failed".

E2E_PASSED=0
E2E_FAILED=0
E2E_FAILURES=()
SCENARIO=""

scenario() {
    SCENARIO=$1
    printf '\n%s ==== %s\n' "$(date +%T)" "$SCENARIO"
}

pass() { E2E_PASSED=$((E2E_PASSED + 1)); printf '  ok    %s\n' "$*"; }
fail() {
    E2E_FAILED=$((E2E_FAILED + 1))
    E2E_FAILURES+=("$SCENARIO: $*")
    printf '  FAIL  %s\n' "$*"
    diagnose || true
}

# diagnose: at the first failure of a scenario, a few lines of what the
# cluster says (the scenario's pods that do not run, each node's conditions
# and taints, the newest Warning events of its namespace, the newest warnings
# and errors of each driver container and each kubelet), so that a run read
# only in part still tells why.
DIAGNOSED=""
diagnose() {
    [ "$DIAGNOSED" = "$SCENARIO" ] && return 0
    DIAGNOSED=$SCENARIO
    declare -F kc >/dev/null || return 0
    {
        kc -n "$NS" get pods -o wide --no-headers 2>/dev/null | awk '$3 != "Running"' | head -6
        kc get nodes --no-headers -o custom-columns='NODE:.metadata.name,CONDITIONS:.status.conditions[?(@.status=="True")].type,TAINTS:.spec.taints[*].key' 2>/dev/null
        kc -n "$NS" get events --field-selector type=Warning --sort-by=.lastTimestamp --no-headers \
            -o custom-columns=OBJECT:.involvedObject.name,REASON:.reason,MESSAGE:.message 2>/dev/null \
            | grep -v ' MissingClusterDNS ' | tail -8
        local p dns=${DRIVER_NS:-}
        for p in $(kc -n "$dns" get pod -l app.kubernetes.io/name=example-csi -o name 2>/dev/null); do
            kc -n "$dns" logs "$p" -c csi-driver --since=10m 2>/dev/null \
                | grep -E 'WARN|ERROR' | tail -3 | sed "s|^|${p#pod/}: |"
        done
        local k
        for k in "${W:-/nonexistent}"/logs/kubelet-*.log; do
            [ -f "$k" ] || continue
            # (less the noise of every run: exec streams closed, containers
            # already gone)
            grep -E '^E[0-9]{4} ' "$k" | grep -vE 'Error on socket receive|ContainerStatus from runtime service failed' \
                | tail -3 | sed "s|^|$(basename "$k" .log): |"
        done
    } 2>&1 | cut -c1-400 | head -36 | sed 's/^/        | /' || true
}

# check WHAT CMD...: passes when CMD succeeds.
check() {
    local what=$1; shift
    if "$@" >/dev/null 2>&1; then pass "$what"; else fail "$what"; fi
}

# check_eq WHAT EXPECTED ACTUAL
check_eq() {
    if [ "$2" = "$3" ]; then pass "$1 ($3)"; else fail "$1: expected '$2', got '$3'"; fi
}

# check_sum WHAT EXPECTED ACTUAL: both the same sha256 checksum (two empty
# answers of a failed read are not a match).
check_sum() {
    if is_sum "$2" && [ "$2" = "$3" ]; then pass "$1 (${3:0:16}...)"
    else fail "$1: expected checksum '$2', got '$3'"; fi
}

# is_sum TEXT...: each TEXT is a sha256 checksum.
is_sum() { local t; for t in "$@"; do [[ $t =~ ^[0-9a-f]{64}$ ]] || return 1; done; }

# eventually SECONDS WHAT CMD...: passes once CMD succeeds within SECONDS.
eventually() {
    local secs=$1 what=$2; shift 2
    local end=$((SECONDS + secs)) start=$SECONDS
    until "$@" >/dev/null 2>&1; do
        if [ $SECONDS -ge $end ]; then fail "$what (not within ${secs}s)"; return 1; fi
        sleep 1
    done
    pass "$what ($((SECONDS - start))s)"
}

# jp KIND/NAME JSONPATH [NAMESPACE]: one field of an object.
jp() { kc -n "${3:-$NS}" get "$1" -o jsonpath="$2" 2>/dev/null; }

# field_is KIND/NAME JSONPATH VALUE
field_is() { [ "$(jp "$1" "$2")" = "$3" ]; }

pod_running() { field_is "pod/$1" '{.status.phase}' Running; }
pvc_bound() { field_is "pvc/$1" '{.status.phase}' Bound; }

# in_pod POD CMD...: runs CMD in the pod's first container.
in_pod() { kc -n "$NS" exec "$1" -- "${@:2}"; }

apply() { kc -n "$NS" apply -f - >/dev/null; }

# volume_of PVC: the driver's volume id of a bound claim.
volume_of() {
    local pv; pv=$(jp "pvc/$1" '{.spec.volumeName}')
    [ -n "$pv" ] && kc get pv "$pv" -o jsonpath='{.spec.csi.volumeHandle}'
}

# pool_files: volume and snapshot files in the pools, one path a line.
pool_files() {
    local p
    for p in "${POOL_DIRS[@]}"; do
        find "$p/volumes" "$p/snapshots" "$p/ephemeral" -mindepth 1 -maxdepth 1 2>/dev/null
    done | sort
}

# transfer_files: what transfers between nodes keep in the pools (holds of
# a source, replicas of a target) and in the nodes' state (arrival records),
# one path a line.
transfer_files() {
    local p
    for p in "${POOL_DIRS[@]}"; do
        find "$p/.holds" "$p/.replicas" -mindepth 1 -maxdepth 1 2>/dev/null
    done
    for p in "$POOL_ROOT/state" "$W"/node-*/example-csi/state; do
        find "$p/controller/transfers" -mindepth 1 -maxdepth 1 2>/dev/null
    done
    return 0
}

# pool_file_of VOLUME_ID: the volume's backing file or directory, in any
# node's pools.
pool_file_of() {
    local p id; id=$(bare_id "$1")
    for p in "${POOL_DIRS[@]}"; do
        for f in "$p/volumes/$id.img" "$p/volumes/$id"; do [ -e "$f" ] && { echo "$f"; return 0; }; done
    done
    return 1
}

# bare_id HANDLE: the node's own id of a volume or snapshot handle (the
# cluster flavor's router hands out ID@NODE, or ID#DIGEST for a long node
# name; the files in the pools are named by ID).
bare_id() { local h=${1%%@*}; echo "${h%%#*}"; }

# pool_dir NODE POOL: where the host sees POOL of NODE (the first node's at
# /var/lib/example-csi, another's under its own folder of the work directory).
pool_dir() {
    if [ "$1" = "${NODES[0]}" ]; then echo "$POOL_ROOT/$2"; else echo "$W/node-$1/example-csi/$2"; fi
}

# node_of_pvc CLAIM: the node the claim's PV is pinned to by the driver's
# topology key.
node_of_pvc() {
    local pv; pv=$(jp "pvc/$1" '{.spec.volumeName}')
    [ -n "$pv" ] && kc get pv "$pv" \
        -o jsonpath='{.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[?(@.key=="topology.example.csi/node")].values[0]}'
}

# image_of CLAIM POOL: the image of a bound claim's volume in POOL of the
# node the claim's PV names.
image_of() {
    echo "$(pool_dir "$(node_of_pvc "$1")" "$2")/volumes/$(bare_id "$(volume_of "$1")").img"
}

# nodes_up: the nodes of NODES whose kubelet has joined, in that order.
nodes_up() {
    local n
    for n in "${NODES[@]}"; do kc get node "$n" >/dev/null 2>&1 && echo "$n"; done
    return 0
}

# on_node NODE: the nodeSelector line that pins a pod to NODE, when there is
# more than one node (nothing else to choose from otherwise).
on_node() {
    [ "$(nodes_up | grep -c .)" -gt 1 ] && echo "  nodeSelector: {kubernetes.io/hostname: $1}"
    return 0
}

# Pod and claim manifests -------------------------------------------------

# pvc NAME SIZE STORAGECLASS [MODE] [extra spec lines]; PVC_LABELS and
# PVC_ANNOTATIONS ("key: value, ...") add to its metadata.
pvc() {
    local mode=${4:-Filesystem}
    apply <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: $1
  labels: {e2e: "true"${PVC_LABELS:+, $PVC_LABELS}}
  annotations: {${PVC_ANNOTATIONS:-}}
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: $mode
  storageClassName: $3
  resources: {requests: {storage: $2}}
${5:-}
EOF
}

# app_pod NAME CLAIM COMMAND USE [spec lines]: a busybox pod running COMMAND
# with the claim, used as USE (its volumeMounts or volumeDevices line).
app_pod() {
    apply <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $1
  labels: {e2e: "true"}
spec:
  terminationGracePeriodSeconds: 1
${5:-}
  containers:
    - name: app
      image: $BUSYBOX_IMAGE
      imagePullPolicy: Never
      command: ["sh", "-c", "$3"]
      $4
  volumes:
    - name: data
      persistentVolumeClaim: {claimName: $2}
EOF
}

# pod NAME CLAIM COMMAND [spec lines]: the claim mounted at /data.
pod() { app_pod "$1" "$2" "$3" "volumeMounts: [{name: data, mountPath: /data}]" "${4:-}"; }

# block_pod NAME CLAIM COMMAND: the claim as the raw device /dev/xvda.
block_pod() { app_pod "$1" "$2" "$3" "volumeDevices: [{name: data, devicePath: /dev/xvda}]"; }

delete_pod() { kc -n "$NS" delete pod "$@" --wait=true --timeout=120s >/dev/null 2>&1 || true; }

# Predicates for eventually/check ------------------------------------------

not() { ! "$@"; }
gone() { ! kc -n "$NS" get "$1" >/dev/null 2>&1; }
all_of() { local c; for c in "$@"; do eval "$c" || return 1; done; }
# count_is N CMD...: CMD prints exactly N non-empty lines
count_is() { local n=$1; shift; [ "$("$@" 2>/dev/null | grep -c .)" = "$n" ]; }
empty_dirs() { [ -z "$(find "$@" -mindepth 1 -maxdepth 1 2>/dev/null)" ]; }
df_over() { local k; k=$(in_pod "$1" df -k "$2" | awk 'NR==2 {print $2}'); [ -n "$k" ] && [ "$k" -gt "$3" ]; }
pvc_condition() { jp "pvc/$1" '{.status.conditions[*].type}' | grep -qE "$2"; }
# bound_count LABEL: how many claims of LABEL are bound
bound_count() {
    kc -n "$NS" get pvc -l "$1" -o jsonpath='{range .items[*]}{.status.phase}{"\n"}{end}' | grep -c Bound
}
bound_count_is() { [ "$(bound_count "$1")" = "$2" ]; }
bound_at_least() { [ "$(bound_count "$1")" -ge "$2" ]; }
# pool_loops [DIR...]: loop devices whose backing file is in a pool (those
# at DIR..., every node's unless named). The node plugin's paths are its
# container's, so they are found by the backing device: the pools' own loop
# devices.
pool_loops() {
    local devs dirs=("$@")
    [ ${#dirs[@]} -gt 0 ] || dirs=("${POOL_DIRS[@]}")
    devs=$(for d in "${dirs[@]}"; do findmnt -n -o MAJ:MIN --mountpoint "$d" | head -1; done | tr -d ' ')
    [ -n "$devs" ] || { echo "no pool loop device found"; return; }
    losetup -n -O NAME,BACK-MAJ:MIN 2>/dev/null | awk -v devs=" $(echo $devs) " 'index(devs, " " $2 " ") {print $1}'
}
# volume_mounts: mounts of volumes under the kubelets' directories, in this
# mount namespace and in those of the other nodes.
volume_mounts() {
    local ns=(/proc/self/mountinfo) f
    for f in "$W"/node-*/mntns.pid; do [ -f "$f" ] && ns+=("/proc/$(cat "$f")/mountinfo"); done
    awk '{print $5}' "${ns[@]}" 2>/dev/null \
        | grep -E '/var/lib/kubelet/(pods/.*/volumes/kubernetes.io~csi|plugins/kubernetes.io/csi/)'
}
# pool_mounts: how many mounts are stacked at each pool's path, on the host
# (every node's pools, as the checks see them) and in each other node's
# mount namespace (its own /var/lib/example-csi), one count a line.
pool_mounts() {
    local p f
    for p in "${POOL_DIRS[@]}"; do awk -v p="$p" '$5 == p' /proc/self/mountinfo | grep -c . || true; done
    for f in "$W"/node-*/mntns.pid; do
        [ -f "$f" ] || continue
        for p in pool ssd; do
            awk -v p="$POOL_ROOT/$p" '$5 == p' "/proc/$(cat "$f")/mountinfo" 2>/dev/null | grep -c . || true
        done
    done
}
# same_list TEXT CMD...: CMD prints exactly TEXT's lines (in sorted order)
same_list() { local want=$1; shift; [ "$("$@" 2>/dev/null | sort)" = "$want" ]; }
