#!/usr/bin/env bash
# The multi-node control plane measured on one machine: two node agents (each
# a driver with its own xfs pool and state, --agent-listen on loopback, mutual
# TLS) and the cluster's controller (--mode router) in front of them.
#
#   hop:      csi-bench create-delete and create-snapshot through the router
#             (every call crosses the mTLS hop to node-a) against node-a's
#             own socket, A B A B A B;
#   spread:   the same through the router with the volumes on node-a and
#             node-b in turn (1 and 16 clients);
#   transfer: a volume's snapshot restored on the other node (its data pulled
#             over the mesh, piece by piece, digests checked, durable at each
#             checkpoint), SIZE of data written at random (all of it
#             allocated) and then half of it, and the first volume again
#             after 1% of it changed (an incremental move); beside each, the
#             same image copied on the same disk (cp --sparse=always
#             --reflink=never, then sync), what a copy on this machine takes.
#
# Usage (root): scripts/bench-mesh.sh OUT [SIZE_MIB] [COUNT]
# CSI_DRIVER_BIN and CSI_BENCH_BIN name the binaries (default: target/release,
# built if missing). MESH_PARTS picks the parts (default: hop,spread,transfer).
# MESH_THREADS=1 samples every thread's CPU of the three processes during each
# move (scripts/thread-cpu.py, into OUT/threads-NAME.txt; the sampling costs a
# little CPU, so the moves' times beside it are not the benchmark's).
# MESH_PERF=1 records the whole machine's CPU with `perf record -a -g` during
# each move (into OUT/perf-NAME.data; `perf report -i FILE --no-children`);
# MESH_PERF=dwarf records the call stacks of code built without frame
# pointers too (large files).
# Everything it makes is torn down on exit.
set -euo pipefail
out=${1:?usage: $0 OUT [SIZE_MIB] [COUNT]}
size_mib=${2:-1024}
count=${3:-300}
parts=",${MESH_PARTS:-hop,spread,transfer},"
part() { [[ $parts == *",$1,"* ]]; }
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh" mesh-bench
mkdir -p "$out"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

"$driver" mesh-authority --dir "$work/mesh" >/dev/null
declare -A port
for n in a b; do
  mkdir -p "$work/$n/pool" "$work/$n/state"
  truncate -s $(( size_mib * 4 + 4096 ))M "$work/$n/pool.img"
  mkfs.xfs -q -m reflink=1 "$work/$n/pool.img"
  mount -o loop "$work/$n/pool.img" "$work/$n/pool"
  port[$n]=$(free_port)
  "$driver" --endpoint "unix://$work/$n/csi.sock" --nodeid "node-$n" --pool "default=$work/$n/pool" \
    --state-dir "$work/$n/state" --allowed-path-root "$work/scratch" --agent-listen "127.0.0.1:${port[$n]}" --mesh-dir "$work/mesh/node" \
    --log-level "${MESH_LOG_LEVEL:-warn}" 2>"$work/$n.log" &
  pids+=($!)
done
"$driver" --endpoint "unix://$work/router.sock" --mode router --mesh-dir "$work/mesh/controller" \
  --agent "node-a=127.0.0.1:${port[a]}" --agent "node-b=127.0.0.1:${port[b]}" \
  --log-level "${MESH_LOG_LEVEL:-warn}" 2>"$work/router.log" &
pids+=($!)
client() { local sock=$1; shift; "$driver" --endpoint "unix://$sock" client --output json "$@"; }
for s in a/csi.sock b/csi.sock router.sock; do
  for _ in $(seq 100); do client "$work/$s" info >/dev/null 2>&1 && break; sleep 0.1; done
done

mkdir -p "$work/scratch"
if part hop; then
echo "== hop: create-delete through the router against node-a's own socket"
"$bench" --compare --scenarios create-delete,create-snapshot --count "$count" --rounds 3 --no-settle \
  --topology topology.example.csi/node=node-a \
  --a-name node-a --a-endpoint "unix://$work/a/csi.sock" \
  --b-name router --b-endpoint "unix://$work/router.sock" \
  --scratch "$work/scratch" --out "$out/hop"
grep -i "create" "$out/hop/results.txt" || true
fi
if part spread; then
echo "== spread: through the router, the volumes on node-a and node-b in turn"
"$bench" --scenarios create-delete,create-snapshot --count "$count" --rounds 3 --no-settle \
  --concurrency 1,16 \
  --topology topology.example.csi/node=node-a --topology topology.example.csi/node=node-b \
  --a-name router-two-nodes --a-endpoint "unix://$work/router.sock" \
  --scratch "$work/scratch" --out "$out/spread"
grep -i "create" "$out/spread/results.txt" || true
fi
part transfer || exit 0

echo "== transfer: a snapshot of ${size_mib} MiB of data restored on the other node"
results="$out/transfer.txt"
: >"$results"
id_of() { python3 -c 'import json,sys; d=json.load(sys.stdin); print(d[sys.argv[1]][sys.argv[2]])' "$@"; }

# fill FILE MIB PERCENT: PERCENT of each 100 MiB of FILE (MIB long) written
# with random data; the rest is left as it was (holes in a new file).
fill() {
  python3 -c '
import os, sys
path, mib, pct = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "r+b" if os.path.exists(path) else "wb") as f:
    if os.fstat(f.fileno()).st_size < mib << 20:
        f.truncate(mib << 20)
    for i in range(mib):
        if i % 100 < pct:
            f.seek(i << 20)
            f.write(os.urandom(1 << 20))
    f.flush()
    os.fsync(f.fileno())' "$@"
}

# write_on_a VOL TAG PERCENT: the volume staged and published on node-a
# while PERCENT of its file "data" is written.
write_on_a() {
  local vol=$1 tag=$2 pct=$3
  local st="$work/scratch/st-$tag" tg="$work/scratch/tg-$tag"
  client "$work/a/csi.sock" node-stage "$vol" --staging "$st" --fs xfs >/dev/null
  client "$work/a/csi.sock" node-publish "$vol" --staging "$st" --target "$tg" --fs xfs >/dev/null
  fill "$tg/data" "$size_mib" "$pct"
  client "$work/a/csi.sock" node-unpublish "$vol" --target "$tg" >/dev/null
  client "$work/a/csi.sock" node-unstage "$vol" --staging "$st" >/dev/null
}

# move SNAP NAME LABEL: restores SNAP on node-b, waits until its data is whole
# there, and prints a line of figures, with a copy of the snapshot's image on
# one disk beside it.
move() {
  local snap=$1 name=$2 label=$3 start made done_at moved sent cstart cdone sampler="" perf=""
  sync
  if [ -n "${MESH_PERF:-}" ]; then
    local graph=(-g)
    [ "$MESH_PERF" = dwarf ] && graph=(--call-graph "dwarf,16384")
    perf record -q -a "${graph[@]}" -o "$out/perf-$name.data" 2>/dev/null &
    perf=$!
    sleep 0.5
  fi
  if [ -n "${MESH_THREADS:-}" ]; then
    "$top/scripts/thread-cpu.py" --until "$work/threads-$name.stop" \
      "node-a=${pids[0]}" "node-b=${pids[1]}" "router=${pids[2]}" >"$out/threads-$name.txt" &
    sampler=$!
  fi
  start=$(date +%s.%N)
  # The answer read by grep, not by a Python started on the transfer's time.
  moved=$(client "$work/router.sock" create-volume "$name" --size "$(( size_mib + 256 ))Mi" \
    --node node-b --fs xfs --source-snapshot "$snap" | grep -o '"volume_id": *"[^"]*"' | cut -d'"' -f4)
  made=$(date +%s.%N)
  # One client that asks node-b on one connection (every 1 ms at first,
  # then less often, down to every 20 ms): a process
  # started per look would take the CPU the transfer needs.
  local arrived
  arrived=$(client "$work/b/csi.sock" transfers --wait "${moved%%@*}" --timeout 3600)
  done_at=$(date +%s.%N)
  if [ -n "$sampler" ]; then touch "$work/threads-$name.stop"; wait "$sampler"; fi
  if [ -n "$perf" ]; then kill -INT "$perf"; wait "$perf" || true; fi
  sent=$(python3 -c 'import json, sys; print(json.load(sys.stdin).get("data_bytes", 0))' <<<"$arrived")
  cstart=$(date +%s.%N)
  cp --sparse=always --reflink=never "$work/a/pool/snapshots/${snap%%@*}.img" "$work/a/pool/copy.img"
  sync
  cdone=$(date +%s.%N)
  rm -f "$work/a/pool/copy.img"
  python3 -c '
import sys
label = sys.argv[1]
start, made, done, sent, cs, cd = map(float, sys.argv[2:8])
mib, t = sent / 2**20, done - start
print(f"{label}: CreateVolume answered in {(made - start) * 1000:.0f} ms; data whole on node-b "
      f"in {t:.2f} s ({mib:.0f} MiB sent, {mib / t:.0f} MiB/s); the snapshot image copied "
      f"on one disk (cp, then sync) in {cd - cs:.2f} s")' \
    "$label" "$start" "$made" "$done_at" "$sent" "$cstart" "$cdone" | tee -a "$results"
}

for pct in 100 50; do
  vol=$(client "$work/router.sock" create-volume "src-$pct" --size "$(( size_mib + 256 ))Mi" \
    --node node-a --fs xfs | id_of volume volume_id)
  write_on_a "$vol" "w$pct" "$pct"
  snap=$(client "$work/router.sock" create-snapshot "snap-$pct" --volume "$vol" | id_of snapshot snapshot_id)
  move "$snap" "moved-$pct" "${size_mib} MiB, ${pct}% allocated"
  if [ "$pct" = 100 ]; then
    # 1% of the data changed since the first move: the second sends that.
    write_on_a "$vol" "d$pct" 1
    first=$snap
    snap=$(client "$work/router.sock" create-snapshot "snap-$pct-2" --volume "$vol" | id_of snapshot snapshot_id)
    move "$snap" "moved-$pct-2" "the same volume again after 1% of it changed (incremental)"
    # What really differs between the two snapshots' images, in 4 KiB
    # blocks and in the transfer's 1 MiB cells (file data and the
    # filesystem's own metadata and log alike).
    python3 -c '
import sys
a, b = open(sys.argv[1], "rb"), open(sys.argv[2], "rb")
blocks = cells = 0
while True:
    x, y = a.read(1 << 20), b.read(1 << 20)
    if not x and not y:
        break
    if x != y:
        cells += 1
        x, y = x.ljust(1 << 20, b"\0"), y.ljust(1 << 20, b"\0")
        blocks += sum(x[i:i + 4096] != y[i:i + 4096] for i in range(0, 1 << 20, 4096))
print(f"between the two snapshots: {blocks * 4096 / 2**20:.1f} MiB differ in 4 KiB blocks, "
      f"{cells} MiB in 1 MiB cells")' "$work/a/pool/snapshots/${first%%@*}.img" \
      "$work/a/pool/snapshots/${snap%%@*}.img" | tee -a "$results"
  fi
done

# The processes' logs (MESH_LOG_LEVEL, default warn) beside the figures.
for n in a b router; do cp "$work/$n.log" "$out/$n.log"; done

# The network's side of the limit: loopback TCP, one stream, in the same run.
python3 -c '
import socket, threading, time
n, chunk = 2 << 30, bytes(1 << 20)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
def sink():
    c, _ = srv.accept(); got = 0
    while got < n:
        b = c.recv(1 << 20)
        if not b: break
        got += len(b)
    c.close()
t = threading.Thread(target=sink); t.start()
s = socket.create_connection(srv.getsockname()); start = time.time()
for _ in range(n >> 20): s.sendall(chunk)
s.close(); t.join()
print(f"loopback TCP, one stream: {n / 2**20 / (time.time() - start):.0f} MiB/s")' | tee -a "$results"
