#!/usr/bin/env bash
# Where an xfs volume's mount spends its time under CPU load, and what user
# space can do about it: the floor of NodeStageVolume for `image` volumes.
#
#   sudo scripts/bench-xfs-mount.sh [COUNT] [--no-stress]
#
# Makes a 1 GiB xfs image (as a volume's, `mkfs.xfs -m reflink=1`), and for each
# of COUNT rounds (default 15) a reflinked copy of it on a loop device, then
# times mount(8) of that device under four settings, taking turns:
#   plain          the mount as the driver makes it;
#   mounter-fifo   the mount run SCHED_FIFO 50 (`chrt -f 50`): the most a
#                  driver could do for its own thread;
#   kthreadd-fifo  kthreadd (pid 2) made SCHED_FIFO 50 for the mount, then put
#                  back: the kernel threads the mount waits for get a CPU at
#                  once (a change to the whole machine, not a driver's to make);
#   ext4           an ext4 image the same way, plain, for comparison.
# Beside `stress-ng --io 2 --cpu 1` unless --no-stress. Prints p50/p90/max in ms
# (each includes starting mount(8), the same in every setting).
# Needs root, xfsprogs, e2fsprogs, util-linux (chrt), stress-ng.
set -euo pipefail

COUNT=15
STRESS=1
for a in "$@"; do
    case "$a" in
        --no-stress) STRESS="" ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) COUNT=$a ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "$0: needs root (loop devices, mounts)" >&2; exit 2; }
for tool in mkfs.xfs mkfs.ext4 losetup chrt cp python3; do
    command -v "$tool" >/dev/null || { echo "$0: $tool is missing" >&2; exit 2; }
done
[ -z "$STRESS" ] || command -v stress-ng >/dev/null || { echo "$0: stress-ng is missing" >&2; exit 2; }

WORK=$(mktemp -d /var/tmp/xfs-mount.XXXXXX)
STRESS_PID=""
KTHREADD_POLICY=$(chrt -p 2 | awk -F': ' '/policy/ {print $2}')
cleanup() {
    [ -z "$STRESS_PID" ] || { kill "$STRESS_PID" 2>/dev/null; wait "$STRESS_PID" 2>/dev/null || true; }
    chrt -o -p 0 2 2>/dev/null || true
    findmnt -rn -o TARGET | grep "^$WORK/" | sort -r | xargs -r -n1 umount 2>/dev/null || true
    for dev in /sys/block/loop*; do
        f=$(cat "$dev/loop/backing_file" 2>/dev/null || true)
        case "$f" in "$WORK"/*) losetup -d "/dev/$(basename "$dev")" 2>/dev/null || true ;; esac
    done
    findmnt -rn -o TARGET | grep "^$WORK" | sort -r | xargs -r -n1 umount 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

# The pool: an xfs with reflink, as the driver's pools are.
truncate -s 8G "$WORK/pool.img"
mkfs.xfs -q -m reflink=1 "$WORK/pool.img"
mkdir "$WORK/pool" "$WORK/mnt"
mount -o loop "$WORK/pool.img" "$WORK/pool"
truncate -s 1G "$WORK/pool/xfs.img" "$WORK/pool/ext4.img"
mkfs.xfs -q -m reflink=1 "$WORK/pool/xfs.img"
mkfs.ext4 -q -F "$WORK/pool/ext4.img"
sync

# time_mount FS [PREFIX...]: ms of one mount of a fresh reflinked copy.
time_mount() {
    local fs=$1 copy dev t0 t1
    shift
    copy="$WORK/pool/copy-$RANDOM$RANDOM.img"
    cp --reflink=always "$WORK/pool/$fs.img" "$copy"
    dev=$(losetup -f --show "$copy")
    t0=$(date +%s%N)
    "$@" mount -t "$fs" "$dev" "$WORK/mnt"
    t1=$(date +%s%N)
    umount "$WORK/mnt"
    losetup -d "$dev"
    rm -f "$copy"
    echo $(( (t1 - t0) / 1000 ))
}

if [ -n "$STRESS" ]; then
    stress-ng --io 2 --cpu 1 --quiet &
    STRESS_PID=$!
    sleep 2
fi
declare -A T=()
for _ in $(seq "$COUNT"); do
    T[plain]+="$(time_mount xfs) "
    T[mounter-fifo]+="$(time_mount xfs chrt -f 50) "
    chrt -f -p 50 2
    T[kthreadd-fifo]+="$(time_mount xfs) "
    chrt -o -p 0 2
    T[ext4]+="$(time_mount ext4) "
done

LOAD=quiet
[ -z "$STRESS" ] || LOAD="beside stress-ng --io 2 --cpu 1"
echo "xfs mount of a 1 GiB volume's reflinked copy, $COUNT each, $LOAD; kernel $(uname -r), $(nproc) CPUs; kthreadd normally $KTHREADD_POLICY"
echo "| setting | p50 ms | p90 ms | max ms |"
echo "|---|---:|---:|---:|"
for k in plain mounter-fifo kthreadd-fifo ext4; do
    python3 - "$k" ${T[$k]} <<'XEOF'
import math, sys
name, xs = sys.argv[1], sorted(int(x) / 1000 for x in sys.argv[2:])
pick = lambda q: xs[min(len(xs) - 1, max(0, math.ceil(len(xs) * q) - 1))]
print(f"| {name} | {pick(0.5):.1f} | {pick(0.9):.1f} | {xs[-1]:.1f} |")
XEOF
done
