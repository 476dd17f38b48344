# shellcheck shell=bash
# Sourced by the benchmark scripts: the release binaries (CSI_DRIVER_BIN and
# CSI_BENCH_BIN name others; built if missing), a work folder $work under
# /tmp named after $1, and its teardown on exit: the processes in $pids
# stopped, every mount and loop device under $work undone, $work removed.
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
driver=${CSI_DRIVER_BIN:-$top/target/release/csi-driver}
bench=${CSI_BENCH_BIN:-$top/target/release/csi-bench}
if [ ! -x "$driver" ] || [ ! -x "$bench" ]; then
  (cd "$top" && cargo build --release -p csi-driver -p csi-bench)
fi
work=$(mktemp -d "/tmp/example-csi-$1.XXXXXX")
pids=()
cleanup() {
  set +e
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  findmnt -rn -o TARGET | grep "^$work/" | sort -r | while read -r m; do umount "$m" || umount -l "$m"; done
  for f in /sys/block/loop*/loop/backing_file; do
    [ -e "$f" ] || continue
    case "$(cat "$f")" in "$work"/*) losetup -d "/dev/$(basename "$(dirname "$(dirname "$f")")")";; esac
  done
  rm -rf "$work"
}
trap cleanup EXIT
