# shellcheck shell=bash
# What the kubelet, containerd and the CNI plugins change on the host, recorded
# before the cluster starts and put back at teardown, so that the machine (and
# whatever runs on it next) is as it was.

SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
         kernel.keys.root_maxkeys kernel.keys.root_maxbytes net.ipv4.ip_forward
         net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables)
# Host paths the cluster creates; each is removed at teardown unless it was
# there before.
HOST_PATHS=(/var/lib/kubelet /var/lib/cni /run/netns /var/lib/example-csi /etc/cni
            /var/log/pods /var/log/containers /run/containerd /var/lib/containerd
            /opt/cni /var/run/secrets)

hoststate_save() {
    local dir=$1
    mkdir -p "$dir"
    : >"$dir/sysctl"
    local k v
    for k in "${SYSCTLS[@]}"; do
        v=$(sysctl -n "$k" 2>/dev/null) && echo "$k=$v" >>"$dir/sysctl"
    done
    : >"$dir/paths"
    local p
    for p in "${HOST_PATHS[@]}"; do [ -e "$p" ] && echo "$p" >>"$dir/paths"; done
    iptables-save >"$dir/iptables" 2>/dev/null || true
    ip6tables-save >"$dir/ip6tables" 2>/dev/null || true
    ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort >"$dir/links"
    ls /run/netns 2>/dev/null | sort >"$dir/netns" || true
    losetup -n -O NAME 2>/dev/null | sort >"$dir/loops" || true
    awk '{print $5}' /proc/self/mountinfo | sort >"$dir/mounts"
    find /sys/fs/cgroup -maxdepth 2 \( -name 'kubepods*' -o -name 'e2e-*' \) 2>/dev/null | sort >"$dir/cgroups" || true
}

hoststate_restore() {
    local dir=$1
    [ -d "$dir" ] || return 0
    local line
    while IFS= read -r line; do
        sysctl -q -w "$line" >/dev/null 2>&1 || true
    done <"$dir/sysctl"
    # nft tables and chains made by the kubelet and CNI go with the restore of
    # the whole ruleset as it was.
    local tool t
    for tool in iptables ip6tables; do
        if [ -s "$dir/$tool" ]; then
            "$tool-restore" <"$dir/$tool" 2>/dev/null || true
        else
            for t in filter nat mangle raw; do "$tool" -t "$t" -F 2>/dev/null; "$tool" -t "$t" -X 2>/dev/null; done
        fi
    done
    # links the CNI made (bridge, veths), network namespaces
    local l
    for l in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort | comm -13 "$dir/links" -); do
        ip link delete "$l" 2>/dev/null || true
    done
    local n
    for n in $(ls /run/netns 2>/dev/null | sort | comm -13 "$dir/netns" -); do
        umount "/run/netns/$n" 2>/dev/null; rm -f "/run/netns/$n"
    done
    local c
    for c in $(find /sys/fs/cgroup -maxdepth 2 \( -name 'kubepods*' -o -name 'e2e-*' \) 2>/dev/null | sort | comm -13 "$dir/cgroups" -); do
        find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
    local p
    for p in "${HOST_PATHS[@]}"; do
        if ! grep -qxF "$p" "$dir/paths" && [ -e "$p" ]; then
            umount_under "$p"
            rm -rf --one-file-system "$p" 2>/dev/null || true
        fi
    done
}

# umount_under PATH: unmounts every mount at or below PATH, deepest first.
umount_under() {
    local p
    p=$(readlink -f "$1" 2>/dev/null || echo "$1")
    local m
    for _ in 1 2 3; do
        local left=0
        while IFS= read -r m; do
            left=1
            umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
        done < <(awk -v p="$p" '$5 == p || index($5, p "/") == 1 {print $5}' /proc/self/mountinfo \
                 | sed 's/\\040/ /g' | sort -r)
        [ "$left" = 0 ] && return 0
    done
}

# hoststate_diff DIR: prints what is still changed (loop devices, mounts, links,
# network namespaces, paths); empty when the machine is as it was.
hoststate_diff() {
    local dir=$1
    # only what this run could have made: other work on the machine may attach
    # and mount at the same time
    local ours="^(${W}|/var/lib/kubelet|/var/lib/example-csi|/run/netns|/run/containerd|/var/lib/cni)(/|\$)"
    comm -13 "$dir/loops" <(losetup -n -O NAME 2>/dev/null | sort) | while read -r l; do
        losetup -n -O BACK-FILE "$l" 2>/dev/null | grep -qE "$ours" && echo "loop device left: $l"
    done
    comm -13 "$dir/mounts" <(awk '{print $5}' /proc/self/mountinfo | sort) | grep -E "$ours" \
        | sed 's/^/mount left: /'
    comm -13 "$dir/links" <(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort) | sed 's/^/link left: /'
    comm -13 "$dir/netns" <(ls /run/netns 2>/dev/null | sort) | sed 's/^/netns left: /'
    local p
    for p in "${HOST_PATHS[@]}"; do
        grep -qxF "$p" "$dir/paths" || { [ -e "$p" ] && echo "path left: $p"; }
    done
    local line k v
    while IFS= read -r line; do
        k=${line%%=*}; v=${line#*=}
        [ "$(sysctl -n "$k" 2>/dev/null)" = "$v" ] || echo "sysctl changed: $k"
    done <"$dir/sysctl"
    return 0
}
