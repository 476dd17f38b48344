#!/usr/bin/env bash
# Runs the official CSI conformance suite (csi-sanity) against csi-driver, once per
# configuration below, each on a throwaway pool made for it. Usage:
#   csi-sanity/run.sh [CONFIG ...]      (default: every configuration)
# CSI_SANITY_FLAGS adds csi-sanity flags after the configuration's own, which they
# override (e.g. CSI_SANITY_FLAGS="-csi.testvolumesize 67108864"); CSI_DRIVER_BIN
# runs that driver binary instead of building one.
# Needs root (loop devices, mounts). Everything it makes is torn down on exit,
# also when specs fail or the run is interrupted.
set -euo pipefail

CSI_SANITY_VERSION=v5.6.0
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
export PATH="$PATH:/usr/local/go/bin:$(go env GOPATH 2>/dev/null || echo /root/go)/bin:/usr/sbin:/sbin"

# name | pool filesystem | driver flags | volume parameters (k=v,...) | volume MiB
# | processes: 1 (--mode all) or 2 (--mode controller and --mode node on one pool
# and state dir, as in the central deployment; csi-sanity gets both sockets)
# (xfs cannot be made smaller than 300 MiB, btrfs than 128 MiB)
CONFIGS=(
  "xfs-image|xfs|--default-fstype=xfs --enable-attach --max-volumes-per-node=16|kind=image|512|1"
  "btrfs-dir|btrfs|--default-fstype=ext4 --enable-attach --max-volumes-per-node=16|kind=dir|64|1"
  "ext4-image|ext4|--default-fstype=ext4 --enable-attach --max-volumes-per-node=16|kind=image|64|1"
  "btrfs-image|btrfs|--default-fstype=btrfs --enable-attach --max-volumes-per-node=16|kind=image|256|1"
  "xfs-image-two-processes|xfs|--default-fstype=xfs --enable-attach --max-volumes-per-node=16|kind=image|512|2"
)

if [ "$(id -u)" != 0 ]; then
  echo "csi-sanity/run.sh: needs root (loop devices and mounts)" >&2
  exit 1
fi

if ! csi-sanity -h 2>&1 | grep -q -- -csi.testvolumemutableparameters || [ "$(cat "$here/.work/version" 2>/dev/null)" != "$CSI_SANITY_VERSION" ]; then
  echo "== installing csi-sanity $CSI_SANITY_VERSION"
  go install "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$CSI_SANITY_VERSION"
  mkdir -p "$here/.work" && echo "$CSI_SANITY_VERSION" > "$here/.work/version"
fi

driver="${CSI_DRIVER_BIN:-}"
if [ -z "$driver" ]; then
  (cd "$top" && cargo build --quiet --bin csi-driver)
  driver="${CARGO_TARGET_DIR:-$top/target}/debug/csi-driver"
fi

work=$(mktemp -d /tmp/example-csi-sanity.XXXXXX)
pid="" pid2=""
detach_below() { # detach loop devices whose backing file lies in the work dir
  for f in /sys/block/loop*/loop/backing_file; do
    [ -e "$f" ] || continue
    case "$(cat "$f")" in "$work"/*) losetup -d "/dev/$(basename "$(dirname "$(dirname "$f")")")" 2>/dev/null;; esac
  done
}
teardown() {
  set +e
  for p in $pid $pid2; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  pid="" pid2=""
  # Volumes' mounts first (deepest first), then their loop devices, then the pools:
  # a pool unmounted lazily while an image in it is attached would hide that image's
  # path and leak its loop device.
  findmnt -rn -o TARGET | grep "^$work/.*/target/" | sort -r | while read -r m; do umount "$m"; done
  for f in /sys/block/loop*/loop/backing_file; do
    [ -e "$f" ] || continue
    case "$(cat "$f")" in "$work"/*/pool/*) losetup -d "/dev/$(basename "$(dirname "$(dirname "$f")")")";; esac
  done
  findmnt -rn -o TARGET | grep "^$work/" | sort -r | while read -r m; do umount "$m" || umount -l "$m"; done
  detach_below
}
cleanup_all() { teardown; rm -rf "$work"; }
trap cleanup_all EXIT
trap 'exit 130' INT TERM

skips_for() { # config name -> ginkgo skip regex from skip.txt
  local name=$1 re=""
  while IFS='|' read -r cfg spec _reason; do
    cfg=$(echo "$cfg" | xargs); spec=$(echo "$spec" | xargs)
    [ -z "$cfg" ] || [[ "$cfg" == \#* ]] && continue
    # shellcheck disable=SC2053
    if [[ "$name" == $cfg ]]; then re="${re:+$re|}$spec"; fi
  done < "$here/skip.txt"
  echo "$re"
}

configs_run=0 total_ran=0 total_passed=0 total_failed=0 total_skipped=0 failed_configs=()
selected=("$@")
for entry in "${CONFIGS[@]}"; do
  IFS='|' read -r name fs flags params mib procs <<<"$entry"
  if [ ${#selected[@]} -gt 0 ] && [[ ! " ${selected[*]} " == *" $name "* ]]; then continue; fi
  configs_run=$((configs_run + 1))
  echo "== csi-sanity: $name (pool $fs, $flags, parameters $params, $procs process(es))"
  d="$work/$name"; mkdir -p "$d/pool" "$d/state" "$d/target"
  truncate -s 20G "$d/pool.img"
  case "$fs" in
    xfs) mkfs.xfs -q -m reflink=1 "$d/pool.img" ;;
    btrfs) mkfs.btrfs -q "$d/pool.img" >/dev/null ;;
    ext4) mkfs.ext4 -q -F "$d/pool.img" ;;
  esac
  mount -o loop "$d/pool.img" "$d/pool"
  : > "$d/params.yaml"
  IFS=',' read -ra kvs <<<"$params"
  for kv in "${kvs[@]}"; do echo "${kv%%=*}: \"${kv#*=}\"" >> "$d/params.yaml"; done
  # The mutable parameters that mean something for the configuration's volumes.
  if [ "$fs" = btrfs ] && [ "$params" = kind=dir ]; then
    printf 'compression: "zstd"\n' > "$d/mutable.yaml"
  else
    printf 'directIO: "true"\nreadAheadKiB: "256"\n' > "$d/mutable.yaml"
  fi
  start_driver() { # socket mode log
    # shellcheck disable=SC2086
    "$driver" --endpoint "unix://$1" --mode "$2" --nodeid sanity-node --pool "$d/pool" \
      --state-dir "$d/state" --log-level "${CSI_LOG_LEVEL:-info}" $flags > "$3" 2>&1 &
  }
  wait_socket() { # socket log
    for _ in $(seq 100); do [ -S "$1" ] && break; sleep 0.1; done
    if [ ! -S "$1" ]; then echo "driver did not start:"; cat "$2"; exit 1; fi
  }
  extra=()
  if [ "$procs" = 2 ]; then
    start_driver "$d/controller.sock" controller "$d/driver.log"; pid=$!
    start_driver "$d/csi.sock" node "$d/node.log"; pid2=$!
    wait_socket "$d/controller.sock" "$d/driver.log"
    wait_socket "$d/csi.sock" "$d/node.log"
    extra+=(-csi.controllerendpoint "$d/controller.sock")
  else
    start_driver "$d/csi.sock" all "$d/driver.log"; pid=$!
    wait_socket "$d/csi.sock" "$d/driver.log"
  fi
  [[ "$flags" == *max-volumes-per-node* ]] && extra+=(-csi.testnodevolumeattachlimit)
  skip=$(skips_for "$name")
  [ -n "$skip" ] && extra+=(-ginkgo.skip "$skip")
  set +e
  # shellcheck disable=SC2086 # CSI_SANITY_FLAGS is split into words on purpose
  csi-sanity -csi.endpoint "$d/csi.sock" \
    -csi.stagingdir "$d/target/staging" -csi.mountdir "$d/target/mount" \
    -csi.testvolumesize $((mib * 1024 * 1024)) -csi.testvolumeexpandsize $((2 * mib * 1024 * 1024)) \
    -csi.testvolumeparameters "$d/params.yaml" -csi.testvolumemutableparameters "$d/mutable.yaml" \
    -csi.testsnapshotparameters /dev/null \
    -csi.junitfile "$here/.work/$name.junit.xml" -ginkgo.no-color "${extra[@]}" \
    ${CSI_SANITY_FLAGS:-} > "$d/sanity.log" 2>&1
  rc=$?
  set -e
  summary=$(grep -E "^Ran [0-9]+ of [0-9]+ Specs" "$d/sanity.log" || true)
  counts=$(grep -E "[0-9]+ Passed \| [0-9]+ Failed" "$d/sanity.log" | tail -1 || true)
  ran=$(echo "$summary" | sed -E 's/^Ran ([0-9]+) of.*/\1/'); ran=${ran:-0}
  p=$(echo "$counts" | sed -E 's/.* ([0-9]+) Passed.*/\1/'); p=${p:-0}
  f=$(echo "$counts" | sed -E 's/.* ([0-9]+) Failed.*/\1/'); f=${f:-0}
  s=$(echo "$counts" | sed -E 's/.* ([0-9]+) Skipped.*/\1/'); s=${s:-0}
  echo "   $summary"
  echo "   $counts"
  if [ $rc -ne 0 ] || [ "$f" != 0 ] || [ "$ran" = 0 ]; then
    failed_configs+=("$name")
    grep -E "^\s*\[FAIL\]" "$d/sanity.log" | sort -u | sed 's/^/   /' || true
    echo "   --- last driver log lines:"; tail -20 "$d/driver.log" | sed 's/^/   /'
    [ -f "$d/node.log" ] && { echo "   --- last node plugin log lines:"; tail -20 "$d/node.log" | sed 's/^/   /'; }
    [ "$f" = 0 ] && f=1
  fi
  total_ran=$((total_ran + ran)); total_passed=$((total_passed + p))
  total_failed=$((total_failed + f)); total_skipped=$((total_skipped + s))
  teardown
  mkdir -p "$here/.work"; cp "$d/sanity.log" "$here/.work/$name.log"; cp "$d/driver.log" "$here/.work/$name.driver.log"
  [ -f "$d/node.log" ] && cp "$d/node.log" "$here/.work/$name.node.log"
done

echo "== csi-sanity total: ran $total_ran specs in $configs_run configurations"
echo "csi-sanity: $total_passed passed, $total_failed failed, $total_skipped skipped"
if [ ${#failed_configs[@]} -gt 0 ]; then
  echo "csi-sanity FAILED in: ${failed_configs[*]} (logs in csi-sanity/.work/)"
  exit 1
fi
