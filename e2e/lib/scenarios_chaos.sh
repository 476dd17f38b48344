# shellcheck shell=bash
# Chaos on the cluster: the node's own services fail under the driver and the
# volumes it serves, as they do on real nodes, and everything comes back with
# its data and leaves nothing behind.
#
# Needs: what scenarios.sh needs; pid_of, stop_pids, start_again,
# apiserver_ready, start_node and mount_pool_images of cluster.sh.

# The kubelet stopped (as `systemctl restart kubelet` does) while volumes are
# staged and published. While it is down one of its pods is deleted from the
# API, so the kubelet, started again, knows that pod only from its directory
# on disk: it must rebuild what it knew of the pod's volume from there and
# have the driver unpublish and unstage it. The other pod runs on untouched.
scenario_kubelet_restart() {
    scenario "the kubelet restarted while volumes are staged and published"
    pvc kr-keep 1Gi example-csi
    pvc kr-gone 1Gi e2e-xfs
    pod kr-keep kr-keep "$WRITE_DATA" "$(on_node "$NODE")"
    pod kr-gone kr-gone "$WRITE_DATA" "$(on_node "$NODE")"
    eventually 120 "two pods on their claims running" all_of "pod_running kr-keep" "pod_running kr-gone" || return
    eventually 60 "both wrote their data" \
        all_of "in_pod kr-keep test -s /data/file.sum" "in_pod kr-gone test -s /data/file.sum" || return
    local sum gone_sum gone_image gone_uid container
    sum=$(in_pod kr-keep cat /data/file.sum)
    gone_sum=$(in_pod kr-gone cat /data/file.sum)
    gone_image=$(pool_file_of "$(volume_of kr-gone)")
    gone_uid=$(jp pod/kr-gone '{.metadata.uid}')
    container=$(jp pod/kr-keep '{.status.containerStatuses[0].containerID}')

    stop_pids "kubelet-$NODE"
    check "the kubelet of $NODE stopped" not kill -0 "$(pid_of "kubelet-$NODE")"
    kc -n "$NS" delete pod kr-gone --grace-period=0 --force >/dev/null 2>&1
    check "a pod deleted from the API while its kubelet is down" gone pod/kr-gone
    sleep 5
    start_again "kubelet-$NODE"
    # (the Node's Ready condition, a few seconds old, says nothing yet)
    eventually 120 "the kubelet serves again (an exec in the pod)" in_pod kr-keep true || return

    check_eq "the pod that stayed runs on in the same container" "$container" \
        "$(jp pod/kr-keep '{.status.containerStatuses[0].containerID}')"
    check_sum "it reads its data" "$sum" "$(in_pod kr-keep sha256sum /data/file | cut -c1-64)"
    check "it writes and syncs" in_pod kr-keep sh -c 'echo after > /data/after && sync'
    eventually 120 "the deleted pod's volume unpublished (found from the kubelet's disk)" \
        count_is 0 mounts_under "/var/lib/kubelet/pods/$gone_uid"
    eventually 60 "and unstaged: no loop device on its image" count_is 0 loops_of "$gone_image"
    eventually 60 "the deleted pod's directory removed by the kubelet" not test -e "/var/lib/kubelet/pods/$gone_uid"
    pod kr-again kr-gone "$READ_DATA" "$(on_node "$NODE")"
    eventually 120 "its claim in a new pod" pod_running kr-again || return
    check_sum "holds the deleted pod's data" "$gone_sum" "$(in_pod kr-again cat /tmp/now.sum)"
    delete_pod kr-keep kr-again
    kc -n "$NS" delete pvc kr-keep kr-gone --wait=true --timeout=120s >/dev/null
    eventually 60 "both volumes deleted from the pools" not test -e "$gone_image"
}

# mounts_under DIR: mounts at or below DIR in this mount namespace.
mounts_under() { awk -v p="$1" '$5 == p || index($5, p "/") == 1 {print $5}' /proc/self/mountinfo; }

# containerd stopped and started again under running pods (their shims keep
# the containers alive meanwhile, as on any node): no container restarts, the
# node plugin included, and the node provisions, stages and publishes anew.
scenario_containerd_restart() {
    scenario "containerd restarted under running pods and the node plugin"
    pvc cr 1Gi example-csi
    pod cr cr "$WRITE_DATA" "$(on_node "$NODE")"
    eventually 120 "pod on the claim running" pod_running cr || return
    eventually 60 "pod wrote its data" in_pod cr test -s /data/file.sum || return
    local sum container plugin sock=$W/containerd-$NODE/containerd.sock
    sum=$(in_pod cr cat /data/file.sum)
    container=$(jp pod/cr '{.status.containerStatuses[0].containerID}')
    plugin=$(driver_container_on "$NODE")

    stop_pids "containerd-$NODE"
    check "containerd of $NODE stopped" not kill -0 "$(pid_of "containerd-$NODE")"
    check "the containers' shims live on without it" test "$(pgrep -fc -- "-address $sock" || true)" -gt 0
    sleep 10
    start_again "containerd-$NODE"
    eventually 60 "containerd answers again" ctr_ --address "$sock" version || return
    eventually 60 "node $NODE Ready" node_ready "$NODE"
    eventually 60 "the kubelet reaches containerd again (an exec in the pod)" in_pod cr true

    check_eq "the pod runs on in the same container" "$container" \
        "$(jp pod/cr '{.status.containerStatuses[0].containerID}')"
    check_eq "so does the node plugin's driver" "$plugin" "$(driver_container_on "$NODE")"
    check_sum "the pod reads its data" "$sum" "$(in_pod cr sha256sum /data/file | cut -c1-64)"
    pvc cr-new 1Gi e2e-xfs
    pod cr-new cr-new "$WRITE_DATA" "$(on_node "$NODE")"
    eventually 120 "a new claim provisioned, staged and published in a new pod" pod_running cr-new
    eventually 60 "which writes its data" in_pod cr-new test -s /data/file.sum
    local images=("$(pool_file_of "$(volume_of cr)")" "$(pool_file_of "$(volume_of cr-new)")")
    delete_pod cr cr-new
    kc -n "$NS" delete pvc cr cr-new --wait=true --timeout=120s >/dev/null
    eventually 60 "both volumes unstaged and deleted from the pools" \
        all_of "not test -e ${images[0]}" "not test -e ${images[1]}"
}

# driver_container_on NODE: the container id of the driver in the node plugin on NODE.
driver_container_on() {
    kc -n "$DRIVER_NS" get pod -l app.kubernetes.io/component=node --field-selector "spec.nodeName=$1" \
        -o jsonpath='{.items[0].status.containerStatuses[?(@.name=="csi-driver")].containerID}' 2>/dev/null
}

# The API server stopped for 30 s while claims are being provisioned (the
# sidecars lose their leases and watches, calls to the driver are in
# flight), then started again: every claim binds to one volume, none is made
# twice or leaked, and the volumes serve pods.
scenario_apiserver_down() {
    scenario "the API server down for 30 s in the middle of provisioning"
    local before
    before=$(default_pool_volumes)
    immediate_claims apiserver-down 1 12
    eventually 60 "provisioning under way (a first claim bound)" bound_at_least apiserver-down=yes 1
    local bound; bound=$(bound_count apiserver-down=yes)
    stop_pids kube-apiserver
    check "the API server stopped with $bound of 12 claims bound" not kc get --raw /readyz
    sleep 30
    start_again kube-apiserver
    apiserver_ready || { fail "the API server did not come back (logs/kube-apiserver.log)"; return; }
    pass "the API server is back"
    eventually 300 "all 12 claims bound" bound_count_is apiserver-down=yes 12
    local pvs made
    pvs=$(kc get pv -o jsonpath='{range .items[*]}{.spec.claimRef.name}{"\n"}{end}' | grep -c '^apiserver-down-')
    check_eq "one PV per claim" 12 "$pvs"
    made=$(comm -13 <(echo "$before") <(default_pool_volumes) | grep -c .)
    check_eq "one new image per claim in the pools, none leaked" 12 "$made"
    pod ad apiserver-down-1 "$WRITE_DATA"
    eventually 120 "a pod on one of them running" pod_running ad
    eventually 60 "which writes its data" in_pod ad test -s /data/file.sum
    delete_pod ad
    kc -n "$NS" delete pvc -l apiserver-down=yes --wait=true --timeout=180s >/dev/null
    eventually 120 "the 12 volumes deleted from the pools, nothing else" same_list "$before" default_pool_volumes
}

# The second node rebooted: a power cut kills every process of the node at
# once (kubelet, containerd, shims, every container: the node plugin and the
# workloads) and with its mount namespace goes every mount made on it; its
# loop devices are detached and its pools unmounted, and containerd's state
# (a tmpfs on a real node) is lost. Then the node boots: pools mounted,
# containerd and kubelet started. The workloads come back on their claims
# (a filesystem and a raw block volume) with their data, each volume staged
# once, the node provisions again, and deleting it all leaves nothing.
scenario_node_reboot() {
    local second=${NODES[1]}
    scenario "node $second rebooted: every process killed, every mount and loop device gone, booted again"
    pvc nr-fs 1Gi example-csi
    pvc nr-raw 256Mi example-csi-block Block
    pod nr-fs nr-fs "$WRITE_ONCE" "$(on_node "$second")"
    app_pod nr-raw nr-raw "$BLOCK_WRITE_ONCE" "volumeDevices: [{name: data, devicePath: /dev/xvda}]" \
        "$(on_node "$second")"
    eventually 120 "a filesystem and a raw block pod running on $second" \
        all_of "pod_running nr-fs" "pod_running nr-raw" || return
    eventually 60 "both wrote their data" \
        all_of "in_pod nr-fs test -s /data/file.sum" "in_pod nr-raw test -e /tmp/written" || return
    local fs_sum raw_sum fs_image raw_image plugin holds
    fs_sum=$(in_pod nr-fs cat /data/file.sum)
    raw_sum=$(in_pod nr-raw sh -c 'dd if=/dev/xvda bs=1M count=4 2>/dev/null | sha256sum | cut -c1-64')
    # the kubelet's hold on the raw block pod's device: a loop device over
    # the device node it published for the pod (found by the pod's uid in
    # its path while that path still resolves)
    holds=$(loops_backed_by_path "$(jp pod/nr-raw '{.metadata.uid}')")
    fs_image=$(pool_file_of "$(volume_of nr-fs)")
    raw_image=$(pool_file_of "$(volume_of nr-raw)")
    plugin=$(driver_container_on "$second")
    local running=("$(jp pod/nr-fs '{.status.containerStatuses[0].containerID}')"
                   "$(jp pod/nr-raw '{.status.containerStatuses[0].containerID}')")

    node_power_cut "$second" || { fail "processes of $second survive SIGKILL"; return; }
    pass "every process of $second killed"
    local l
    # what a power cut takes too: the kubelet's hold first, then the volumes'
    for l in $holds $(loops_of "$fs_image") $(loops_of "$raw_image") \
             $(pool_loops "$(pool_dir "$second" pool)" "$(pool_dir "$second" ssd)"); do
        losetup -d "$l" 2>/dev/null || true
    done
    eventually 60 "no loop device on $second's volumes left (nothing of the node holds them)" \
        all_of "count_is 0 loops_of $fs_image" "count_is 0 loops_of $raw_image" \
        || losetup -l | sed 's/^/        /'
    local p ok=0 pool_devs
    pool_devs=$(for p in pool ssd; do findmnt -n -o SOURCE --mountpoint "$(pool_dir "$second" "$p")"; done)
    for p in pool ssd; do umount "$(pool_dir "$second" "$p")" || ok=1; done
    check_eq "$second's pools unmount" 0 "$ok"
    # their loop devices go with the filesystems (autoclear): gone, unless
    # something of the dead node still holds a pool open
    # shellcheck disable=SC2086
    eventually 30 "the pools' filesystems released (their loop devices gone)" not losetup $pool_devs \
        || { fail "$second cannot boot on pools still in use"; return; }
    rm -rf --one-file-system "$W/containerd-$second/state"

    log "booting $second"
    mount_pool_images "$second-" "$W/node-$second/example-csi" || { fail "cannot mount $second's pools again"; return; }
    start_node 1 "$second" again
    # (its Node's Ready condition, seconds old, says nothing yet)
    eventually 60 "the kubelet of $second serves again" curl -sf "http://127.0.0.1:$((10248 + 10))/healthz"
    eventually 180 "the node plugin on $second runs again, in new containers" \
        plugin_restarted_on "$second" "$plugin"
    check_eq "each of $second's pools mounted once in its namespace after the node plugin's start" "1 1" \
        "$(awk -v r="$POOL_ROOT" '$5 == r "/pool" || $5 == r "/ssd" {n[$5]++} END {print n[r "/pool"] + 0, n[r "/ssd"] + 0}' \
            "/proc/$(cat "$W/node-$second/mntns.pid")/mountinfo")"
    eventually 240 "the workloads run again on their claims" \
        all_of "restarted nr-fs ${running[0]}" "restarted nr-raw ${running[1]}" || return
    eventually 60 "the filesystem pod sees its file" in_pod nr-fs test -s /data/file
    check_sum "and reads what it wrote before the power cut" "$fs_sum" \
        "$(in_pod nr-fs sha256sum /data/file | cut -c1-64)"
    check_sum "the raw block pod reads its device as written before" "$raw_sum" \
        "$(in_pod nr-raw sh -c 'dd if=/dev/xvda bs=1M count=4 2>/dev/null | sha256sum | cut -c1-64')"
    check_eq "each volume staged once: one loop device on each image" "1 1" \
        "$(loops_of "$fs_image" | grep -c .) $(loops_of "$raw_image" | grep -c .)"
    pvc nr-new 1Gi e2e-xfs
    pod nr-new nr-new "$WRITE_DATA" "$(on_node "$second")"
    eventually 120 "a new claim provisioned on $second after the boot, in a pod" pod_running nr-new
    local new_image; new_image=$(pool_file_of "$(volume_of nr-new)")
    delete_pod nr-fs nr-raw nr-new
    eventually 60 "every volume of $second unstaged: no loop device on the images" all_of \
        "count_is 0 loops_of $fs_image" "count_is 0 loops_of $raw_image" "count_is 0 loops_of $new_image"
    kc -n "$NS" delete pvc nr-fs nr-raw nr-new --wait=true --timeout=120s >/dev/null
    eventually 60 "the three volumes deleted from $second's pools" \
        all_of "not test -e $fs_image" "not test -e $raw_image" "not test -e $new_image"
}

# Workloads that write their data once, on their first start, and only keep
# it after: the raw block one marks its device "done" at 8 MiB.
WRITE_ONCE='test -s /data/file.sum || { dd if=/dev/urandom of=/data/file bs=1M count=16 2>/dev/null && sha256sum /data/file | cut -c1-64 > /data/file.sum && sync; }; exec sleep 100000'
BLOCK_WRITE_ONCE='dd if=/dev/xvda bs=4 skip=2097152 count=1 2>/dev/null | grep -q done || { dd if=/dev/urandom of=/dev/xvda bs=1M count=4 conv=fsync 2>/dev/null && printf done | dd of=/dev/xvda bs=4 seek=2097152 conv=fsync 2>/dev/null; }; touch /tmp/written; exec sleep 100000'

# plugin_restarted_on NODE OLD: the node plugin on NODE ready, its driver in
# a container other than OLD.
plugin_restarted_on() {
    local now; now=$(driver_container_on "$1")
    [ -n "$now" ] && [ "$now" != "$2" ] || return 1
    kc -n "$DRIVER_NS" wait pod -l app.kubernetes.io/component=node --field-selector "spec.nodeName=$1" \
        --for=condition=Ready --timeout=5s >/dev/null
}

# restarted POD OLD: POD running, ready, in a container other than OLD.
restarted() {
    local now; now=$(jp "pod/$1" '{.status.containerStatuses[0].containerID}')
    [ -n "$now" ] && [ "$now" != "$2" ] && field_is "pod/$1" '{.status.containerStatuses[0].ready}' true
}

# node_power_cut NAME: every process of node NAME (one with a mount namespace
# of its own) killed with SIGKILL: its kubelet, containerd, the shims and what
# they run (every container, in the node's cgroup), and the holder of its
# mount namespace, so the namespace and every mount in it go with them.
node_power_cut() {
    local name=$1 pid
    local sock=$W/containerd-$name/containerd.sock
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        local pids=() alive=()
        pids+=("$(pid_of "kubelet-$name")" "$(pid_of "containerd-$name")" "$(pid_of "mntns-$name")")
        mapfile -t -O ${#pids[@]} pids < <(pgrep -f -- "-address $sock"; node_cgroup_procs "$name")
        for pid in "${pids[@]}"; do [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
        [ ${#alive[@]} -eq 0 ] && return 0
        kill -KILL "${alive[@]}" 2>/dev/null
        sleep 0.5
    done
    return 1
}

# node_cgroup_procs NAME: the processes in the cgroup node NAME's kubelet puts
# its pods under.
node_cgroup_procs() {
    local d=/sys/fs/cgroup/pids/e2e-$1
    [ -d "$d" ] || d=/sys/fs/cgroup/memory/e2e-$1
    find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null
}

# loops_backed_by_path TEXT: loop devices whose backing file's path has TEXT in it.
loops_backed_by_path() {
    losetup -n -O NAME,BACK-FILE 2>/dev/null | awk -v t="$1" 'index($2, t) {print $1}'
}
