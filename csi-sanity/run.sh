#!/usr/bin/env bash
# Runs the official CSI conformance suite (csi-sanity) against csi-driver, once per
# configuration below, each on a throwaway pool made for it. Usage:
#   csi-sanity/run.sh [CONFIG ...]      (default: every configuration)
# CSI_SANITY_FLAGS adds csi-sanity flags after the configuration's own, which they
# override (e.g. CSI_SANITY_FLAGS="-csi.testvolumesize 67108864"); CSI_DRIVER_BIN
# runs that driver binary instead of building one.
# Needs root (loop devices, mounts). Everything it makes is torn down on exit,
# also when specs fail or the run is interrupted.
#
# The specs in skip.txt are skipped always or only where a probe of this machine
# fails (see probes below); the summary names every skipped spec with its reason,
# also those csi-sanity skips by itself.
set -euo pipefail

CSI_SANITY_VERSION=v5.6.0
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
# shellcheck source=scripts/preamble.sh
. "$top/scripts/preamble.sh"

# name | pool filesystem | driver flags | volume parameters (k=v,...) | volume MiB
# | processes: 1 (--mode all) or 2 (--mode controller and --mode node on one pool
# and state dir, as in the central deployment; csi-sanity gets both sockets)
# | access type of every volume csi-sanity makes: mount or block (the raw loop
# device; a dir volume has none, so the block configurations are image ones)
# (xfs cannot be made smaller than 300 MiB, btrfs than 128 MiB)
# ext4-node-expansion runs the driver as the distributed deployment does: without
# ControllerExpandVolume, csi-sanity's NodeExpandVolume spec must grow the image
# and the mounted filesystem online (elsewhere the controller grows the image
# before the volume is staged, and the spec finds the filesystem at full size).
# Every configuration sets --max-volumes-per-node, so csi-sanity also runs its
# attach-limit spec (-csi.testnodevolumeattachlimit).
CONFIGS=(
  "xfs-image|xfs|--default-fstype=xfs --enable-attach --max-volumes-per-node=16|kind=image|512|1|mount"
  "btrfs-dir|btrfs|--default-fstype=ext4 --enable-attach --max-volumes-per-node=16|kind=dir|64|1|mount"
  "ext4-image|ext4|--default-fstype=ext4 --enable-attach --max-volumes-per-node=16|kind=image|64|1|mount"
  "btrfs-image|btrfs|--default-fstype=btrfs --enable-attach --max-volumes-per-node=16|kind=image|256|1|mount"
  "ext4-node-expansion|ext4|--default-fstype=ext4 --disable-controller-expansion --enable-attach --max-volumes-per-node=16|kind=image|64|1|mount"
  "xfs-image-two-processes|xfs|--default-fstype=xfs --enable-attach --max-volumes-per-node=16|kind=image|512|2|mount"
  "xfs-image-block|xfs|--enable-attach --max-volumes-per-node=16|kind=image|64|1|block"
  "ext4-image-block|ext4|--enable-attach --max-volumes-per-node=16|kind=image|64|1|block"
  "btrfs-image-block|btrfs|--enable-attach --max-volumes-per-node=16|kind=image|64|1|block"
  "ext4-node-expansion-block|ext4|--disable-controller-expansion --enable-attach --max-volumes-per-node=16|kind=image|64|1|block"
  "xfs-image-two-processes-block|xfs|--enable-attach --max-volumes-per-node=16|kind=image|64|2|block"
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

# Probes: what this machine can do that some specs need. Each failed probe is a
# "when" of skip.txt.
failed_probes=()
# Online growth of a mounted ext4: resize2fs needs CAP_SYS_RESOURCE, which some
# machines withhold. A 32 MiB ext4 on a loop device is mounted, its image doubled,
# and grown while mounted; only resize2fs may fail (anything else stops the run:
# a broken probe must not turn into a skip).
probe_online_ext4_grow() {
  local p="$work/probe-ext4" dev rc=1
  broken() { echo "csi-sanity/run.sh: the online ext4 probe failed to $1" >&2; exit 1; }
  mkdir -p "$p/mnt"
  truncate -s 32M "$p/img" && mkfs.ext4 -q -F "$p/img" >/dev/null || broken "make its image"
  dev=$(losetup -f --show "$p/img") || broken "attach its image"
  mount "$dev" "$p/mnt" || broken "mount $dev"
  truncate -s 64M "$p/img" && losetup -c "$dev" || broken "grow $dev"
  resize2fs "$dev" > "$p/resize.log" 2>&1 && rc=0
  [ $rc = 0 ] || sed 's/^/   resize2fs: /' "$p/resize.log"
  umount "$p/mnt"; losetup -d "$dev"; rm -rf "$p"
  return $rc
}
if probe_online_ext4_grow; then
  echo "== probe: a mounted ext4 grows online here"
else
  echo "== probe: a mounted ext4 cannot be grown here (no-online-ext4-grow)"
  failed_probes+=(no-online-ext4-grow)
fi

trim() { local v=$1; v=${v#"${v%%[![:space:]]*}"}; printf '%s' "${v%"${v##*[![:space:]]}"}"; }

skip_entries() { # config name -> "spec regex|reason" lines of skip.txt that apply here
  local name=$1
  while IFS='|' read -r cfg spec when reason; do
    cfg=$(trim "$cfg"); spec=$(trim "$spec"); when=$(trim "$when")
    [ -z "$cfg" ] || [[ "$cfg" == \#* ]] && continue
    # shellcheck disable=SC2053
    [[ "$name" == $cfg ]] || continue
    if [ "$when" = always ] || [[ " ${failed_probes[*]} " == *" $when "* ]]; then
      echo "$spec|$(trim "$reason") (skip.txt, when: $when)"
    fi
  done < "$here/skip.txt"
}

# The specs the junit report of a run marks skipped, one "spec|message" a line.
skipped_specs() {
  python3 - "$1" <<'PY'
import sys, xml.etree.ElementTree as ET
for case in ET.parse(sys.argv[1]).iter("testcase"):
    sk = case.find("skipped")
    if sk is not None:
        msg = " ".join((sk.get("message") or "").split())
        print(f"{case.get('name', '')}|{msg}")
PY
}

configs_run=0 total_ran=0 total_passed=0 total_failed=0 total_skipped=0 failed_configs=()
skipped_lines=() config_lines=()
selected=("$@")
for entry in "${CONFIGS[@]}"; do
  IFS='|' read -r name fs flags params mib procs access <<<"$entry"
  if [ ${#selected[@]} -gt 0 ] && [[ ! " ${selected[*]} " == *" $name "* ]]; then continue; fi
  configs_run=$((configs_run + 1)) started=$SECONDS
  echo "== csi-sanity: $name (pool $fs, $flags, parameters $params, $procs process(es), $access volumes)"
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
      --state-dir "$d/state" --allowed-path-root "$d/target" --log-level "${CSI_LOG_LEVEL:-info}" $flags > "$3" 2>&1 &
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
  extra+=(-csi.testvolumeaccesstype "$access")
  entries=$(skip_entries "$name")
  skip=$(echo "$entries" | cut -d'|' -f1 | grep -v '^$' | paste -sd'|' || true)
  [ -n "$skip" ] && extra+=(-ginkgo.skip "$skip")
  mkdir -p "$here/.work"; rm -f "$here/.work/$name.junit.xml"
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
  # Every skipped spec with its reason: ours from skip.txt, the others csi-sanity's.
  if [ -f "$here/.work/$name.junit.xml" ]; then
    while IFS='|' read -r spec msg; do
      [ -z "$spec" ] && continue
      why="csi-sanity: $msg"
      [ "$msg" = pending ] && why="csi-sanity: pending (csi-test itself marks the spec as not ready)"
      while IFS='|' read -r re reason; do
        [ -n "$re" ] && echo "$spec" | grep -qE "$re" && why=$reason
      done <<<"$entries"
      skipped_lines+=("$name: $spec -- $why")
    done < <(skipped_specs "$here/.work/$name.junit.xml")
  fi
  config_lines+=("$(printf '%-30s ran %3s, %3s passed, %s failed, %2s skipped, %3ss' \
    "$name" "$ran" "$p" "$f" "$s" $((SECONDS - started)))")
  total_ran=$((total_ran + ran)); total_passed=$((total_passed + p))
  total_failed=$((total_failed + f)); total_skipped=$((total_skipped + s))
  teardown
  mkdir -p "$here/.work"; cp "$d/sanity.log" "$here/.work/$name.log"; cp "$d/driver.log" "$here/.work/$name.driver.log"
  [ -f "$d/node.log" ] && cp "$d/node.log" "$here/.work/$name.node.log"
done

echo "== csi-sanity total: ran $total_ran specs in $configs_run configurations"
printf '  %s\n' "${config_lines[@]}"
echo "csi-sanity: $total_passed passed, $total_failed failed, $total_skipped skipped"
# The same counts for a program to read (scripts/test-all.sh): RESULT_JSON=FILE.
if [ -n "${RESULT_JSON:-}" ]; then
  printf '{"passed": %d, "failed": %d, "skipped": %d, "failed_configurations": %d}\n' \
    "$total_passed" "$total_failed" "$total_skipped" "${#failed_configs[@]}" >"$RESULT_JSON"
fi
echo "probes failed on this machine: ${failed_probes[*]:-none}"
if [ ${#skipped_lines[@]} -gt 0 ]; then
  echo "skipped specs:"
  printf '  %s\n' "${skipped_lines[@]}"
fi
if [ ${#failed_configs[@]} -gt 0 ]; then
  echo "csi-sanity FAILED in: ${failed_configs[*]} (logs in csi-sanity/.work/)"
  exit 1
fi
