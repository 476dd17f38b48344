#!/usr/bin/env bash
# Compares csi-driver (A) with the reference driver, csi-driver-host-path's
# hostpathplugin (B), side by side on this machine, and writes the report
# (results.txt, results.json, scale.svg, snapshot.svg, machine.txt) to OUT.
#
#   sudo scripts/bench-compare.sh OUT [--stress] [--ours-only]
#                                     [--hostpath-version vX.Y.Z] [--hostpath-bin FILE]
#                                     [--pool-size 64G] [--work DIR] [--driver-flag FLAG]...
#                                     [--b-driver FILE] [-- csi-bench flags...]
#
# Needs root (loop devices, mounts), cargo, go, xfsprogs; stress-ng for --stress.
# Each driver gets its own loop-mounted xfs image (same size, same mkfs options);
# hostpath's state and data dir (-statedir) lies in its image, ours (--pool,
# --state-dir) in ours.
#
# --stress runs `stress-ng --io 2 --cpu 1` beside both drivers for the whole run.
# --ours-only measures csi-driver alone (no reference to build): the goals that
# compare with the reference are then reported as not measured.
# --driver-flag FLAG (repeatable) adds FLAG to csi-driver's command line, e.g.
# --driver-flag --expedite-freeze; machine.txt names them.
# --b-driver FILE measures another build of csi-driver (an earlier commit's
# release build) as B instead of the reference, started the same way on its
# own pool: a before/after comparison of a change. The report's goal lines then
# compare A with that build, not with the reference.
#
# Without csi-bench flags the run measures every goal of the report: volumes
# present up to 100,000 (the reference is given at most 10,000: each of its
# changes rewrites its whole state), snapshots of up to 16 GiB of data.
#
# hostpathplugin is built from the Go module proxy at a pinned release through a
# wrapper module (its go.mod has `replace` lines, so `go install pkg@version` is
# refused): the wrapper requires it and repeats its replace block. Where the proxy
# does not serve the module, --hostpath-bin FILE uses a hostpathplugin binary of
# that release built elsewhere. Nothing of it lands in this repository: all is
# built under the work directory (default /tmp/csi-bench-work).
set -euo pipefail

HOSTPATH_MODULE=github.com/kubernetes-csi/csi-driver-host-path
HOSTPATH_VERSION=v1.18.0
HOSTPATH_BIN=""
POOL_SIZE=64G
STRESS=""
OURS_ONLY=""
WORK=/tmp/csi-bench-work
OUT=""
BENCH_ARGS=()
DRIVER_FLAGS=()
B_DRIVER=""

while [ $# -gt 0 ]; do
    case "$1" in
        --stress) STRESS=1; shift ;;
        --ours-only) OURS_ONLY=1; shift ;;
        --hostpath-version) HOSTPATH_VERSION=$2; shift 2 ;;
        --hostpath-bin) HOSTPATH_BIN=$(realpath "$2"); shift 2 ;;
        --pool-size) POOL_SIZE=$2; shift 2 ;;
        --work) WORK=$2; shift 2 ;;
        --driver-flag) DRIVER_FLAGS+=("$2"); shift 2 ;;
        --b-driver) B_DRIVER=$(realpath "$2"); shift 2 ;;
        --) shift; BENCH_ARGS=("$@"); break ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        -*) echo "unknown flag $1" >&2; exit 2 ;;
        *) OUT=$1; shift ;;
    esac
done
[ -n "$OUT" ] || { echo "usage: $0 OUT [flags] [-- csi-bench flags]" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "$0: needs root (loop devices, mounts)" >&2; exit 2; }
for tool in cargo go mkfs.xfs losetup mount tar; do
    command -v "$tool" >/dev/null || { echo "$0: $tool is missing (scripts/install-deps.sh)" >&2; exit 2; }
done
if [ -n "$STRESS" ] && ! command -v stress-ng >/dev/null; then
    echo "$0: --stress needs stress-ng (apt-get install stress-ng)" >&2
    exit 2
fi
if [ ${#BENCH_ARGS[@]} = 0 ]; then
    # The commas are csi-bench's list syntax, inside one argument.
    # shellcheck disable=SC2054
    BENCH_ARGS=(--scale-steps 0,2000,10000,100000 --memory-volumes 10000,100000
        --startup-volumes 10000,100000 --startup-repeats 3 --snapshot-sizes 100Mi,1Gi,16Gi
        --b-max-volumes 10000)
fi

ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" "$WORK"
OUT=$(realpath "$OUT")
WORK=$(realpath "$WORK")

STRESS_PID=""
cleanup() {
    [ -z "$STRESS_PID" ] || { kill "$STRESS_PID" 2>/dev/null; wait "$STRESS_PID" 2>/dev/null || true; }
    # Everything mounted or attached below the work directory, deepest first.
    for _ in 1 2 3; do
        { findmnt -rn -o TARGET | grep "^$WORK/" || true; } | sort -r | while read -r m; do
            umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
        done
        for dev in /sys/block/loop*; do
            f=$(cat "$dev/loop/backing_file" 2>/dev/null || true)
            case "$f" in "$WORK"/*) losetup -d "/dev/$(basename "$dev")" 2>/dev/null || true ;; esac
        done
    done
}
trap cleanup EXIT
cleanup

echo "== building csi-driver and csi-bench (release)"
(cd "$ROOT" && cargo build --release -p csi-driver -p csi-bench --bins)
DRIVER="$ROOT/target/release/csi-driver"
BENCH="$ROOT/target/release/csi-bench"

HOSTPATH="$WORK/hostpathplugin-$HOSTPATH_VERSION"
HOSTPATH_HOW=""
if [ -n "$B_DRIVER" ]; then
    [ -x "$B_DRIVER" ] || { echo "$0: --b-driver $B_DRIVER is not an executable" >&2; exit 2; }
    echo "== csi-driver against another build of it: $B_DRIVER"
elif [ -n "$OURS_ONLY" ]; then
    echo "== csi-driver alone (--ours-only)"
elif [ ! -x "$HOSTPATH" ]; then
    echo "== building hostpathplugin $HOSTPATH_VERSION"
    W="$WORK/hostpath-wrapper"
    rm -rf "$W" && mkdir -p "$W"
    if gomod=$(cd "$W" && go mod download -json "$HOSTPATH_MODULE@$HOSTPATH_VERSION" 2>/dev/null | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p') && [ -n "$gomod" ]; then
        {
            echo "module example.invalid/hostpath-wrapper"
            echo
            grep '^go ' "$gomod"
            echo
            echo "require $HOSTPATH_MODULE $HOSTPATH_VERSION"
            echo
            # The replace lines, one-line form and block form alike.
            awk '/^replace \($/{b=1; print; next} b{print; if ($0 ~ /^\)/) b=0; next} /^replace /{print}' "$gomod"
        } > "$W/go.mod"
        (cd "$W" && go get "$HOSTPATH_MODULE/cmd/hostpathplugin@$HOSTPATH_VERSION" &&
            go build -o "$HOSTPATH" "$HOSTPATH_MODULE/cmd/hostpathplugin")
        HOSTPATH_HOW="wrapper module requiring $HOSTPATH_MODULE $HOSTPATH_VERSION (Go module proxy)"
    elif [ -n "$HOSTPATH_BIN" ]; then
        echo "the Go module proxy does not serve $HOSTPATH_MODULE@$HOSTPATH_VERSION; using $HOSTPATH_BIN"
        cp "$HOSTPATH_BIN" "$HOSTPATH"
        HOSTPATH_HOW="binary given with --hostpath-bin ($HOSTPATH_BIN)"
    else
        echo "$0: the Go module proxy does not serve $HOSTPATH_MODULE@$HOSTPATH_VERSION;" >&2
        echo "  give a hostpathplugin binary of that release with --hostpath-bin FILE" >&2
        exit 1
    fi
    echo "$HOSTPATH_HOW" > "$HOSTPATH.how"
else
    HOSTPATH_HOW="$(cat "$HOSTPATH.how" 2>/dev/null || echo "built earlier") (kept in $HOSTPATH)"
fi

echo "== pools: two ${POOL_SIZE} loop-mounted xfs images (reflink=1)"
for side in a b; do
    rm -rf "${WORK:?}/$side" "$WORK/$side.img"
    mkdir -p "$WORK/$side"
    truncate -s "$POOL_SIZE" "$WORK/$side.img"
    mkfs.xfs -q -m reflink=1 "$WORK/$side.img"
    mount -o loop "$WORK/$side.img" "$WORK/$side"
done
mkdir -p "$WORK/a/pool" "$WORK/a/state" "$WORK/b/pool" "$WORK/b/state" "$WORK/scratch"
rm -f "$WORK/a.sock" "$WORK/b.sock"

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "nproc: $(nproc)"
    echo "memory: $(awk '/MemTotal/{printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
    echo "kernel: $(uname -r)"
    echo "csi-driver: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown) (release build)${DRIVER_FLAGS[*]:+, flags: ${DRIVER_FLAGS[*]}}"
    if [ -n "$B_DRIVER" ]; then
        echo "B: csi-driver $B_DRIVER (sha256 $(sha256sum "$B_DRIVER" | cut -c1-16)), release build given with --b-driver"
    elif [ -n "$OURS_ONLY" ]; then
        echo "hostpathplugin: not measured (--ours-only)"
    else
        echo "hostpathplugin: $HOSTPATH_VERSION, $HOSTPATH_HOW"
    fi
    echo "pools: xfs (mkfs.xfs -m reflink=1) on ${POOL_SIZE} sparse images, loop-mounted"
    if [ -n "$STRESS" ]; then echo "load: stress-ng --io 2 --cpu 1 beside the drivers"; else echo "load: none added"; fi
    echo "command: $0 $OUT ${STRESS:+--stress }${OURS_ONLY:+--ours-only }${B_DRIVER:+--b-driver $B_DRIVER }${HOSTPATH_BIN:+--hostpath-bin $HOSTPATH_BIN }${DRIVER_FLAGS[*]:+${DRIVER_FLAGS[*]/#/--driver-flag } }${BENCH_ARGS[*]:+-- ${BENCH_ARGS[*]}}"
} > "$OUT/machine.txt"
cat "$OUT/machine.txt"

# csi-driver's command line, for A and (--b-driver) B: SIDE's socket and dirs.
ours() {
    echo "$1 --endpoint unix://$WORK/$2.sock --nodeid bench-node --pool default=$WORK/$2/pool --state-dir $WORK/$2/state --allowed-path-root $WORK/scratch --log-level warn${DRIVER_FLAGS[*]:+ ${DRIVER_FLAGS[*]}}"
}
REFERENCE=()
if [ -n "$B_DRIVER" ]; then
    REFERENCE=(--b-name before --b-start "$(ours "$B_DRIVER" b)" --b-pool "$WORK/b/pool")
elif [ -z "$OURS_ONLY" ]; then
    REFERENCE=(--b-name hostpath
        --b-start "$HOSTPATH -endpoint unix://$WORK/b.sock -nodeid bench-node -statedir $WORK/b/state -capacity dir=1000Ti -capacity image=1000Ti -v 0"
        --b-pool "$WORK/b/state")
fi
[ ${#REFERENCE[@]} = 0 ] || REFERENCE+=(--compare --b-endpoint "unix://$WORK/b.sock")
if [ -n "$STRESS" ]; then
    stress-ng --io 2 --cpu 1 --quiet &
    STRESS_PID=$!
fi

echo "== running csi-bench"
"$BENCH" "${REFERENCE[@]}" \
    --a-name csi-driver \
    --a-endpoint "unix://$WORK/a.sock" \
    --a-start "$(ours "$DRIVER" a)" \
    --a-pool "$WORK/a/pool" \
    --scratch "$WORK/scratch" \
    --out "$OUT" \
    "${BENCH_ARGS[@]}"
echo "== report in $OUT"
