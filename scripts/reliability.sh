#!/usr/bin/env bash
# The long reliability run (docs/reliability.md): the fault-injection
# matrix, the full soak, the soak of volumes moving between two nodes and a
# long fuzz run, each printing its figures. Needs root
# (loop devices, mkfs, mounts). The short versions of the same tests run in CI
# through scripts/test-all.sh (cargo test --workspace -- --include-ignored).
#
#   scripts/reliability.sh                 # everything, full size (about 30 minutes here)
#   FUZZ_SECONDS=600 scripts/reliability.sh fuzz
#   scripts/reliability.sh soak faults hostile mesh
#
# Sizes (environment; the defaults are the full run):
#   SOAK_OPS=20000 SOAK_CLIENTS=32 SOAK_KILLS=20 SOAK_REBOOTS=3 [SOAK_SEED=n]
#   FUZZ_SECONDS=600 [FUZZ_SEED=n] [FUZZ_SAVE=1: add inputs with new answers to fuzz/corpus/]
#   HOSTILE_RUNS=20 (the hostile table, run that many times in a row)
#   MESH_SOAK_OPS=300 MESH_SOAK_KILLS=60 [MESH_SOAK_SEED=n] (volumes moving between nodes)
#   RUNS=1 (the parts, that many times in a row; the sizes of CI's run, 20 times:
#   RUNS=20 SOAK_OPS=2000 SOAK_CLIENTS=8 SOAK_KILLS=5 SOAK_REBOOTS=1 scripts/reliability.sh faults soak)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/preamble.sh
. scripts/preamble.sh
export SOAK_OPS="${SOAK_OPS:-20000}" SOAK_CLIENTS="${SOAK_CLIENTS:-32}"
export SOAK_KILLS="${SOAK_KILLS:-20}" SOAK_REBOOTS="${SOAK_REBOOTS:-3}"
export FUZZ_SECONDS="${FUZZ_SECONDS:-600}"
export MESH_SOAK_OPS="${MESH_SOAK_OPS:-300}" MESH_SOAK_KILLS="${MESH_SOAK_KILLS:-60}"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(faults hostile soak mesh fuzz)

out=$(mktemp -d /tmp/example-csi-reliability.XXXXXX)
echo "logs in $out"
cargo build --tests --quiet --test faults --test hostile --test soak --test mesh_soak --test fuzz
failed=0
runs="${RUNS:-1}"
for run in $(seq "$runs"); do
for p in "${parts[@]}"; do
    echo
    echo "==== $p$([ "$runs" = 1 ] || echo " (run $run of $runs)")"
    start=$(date +%s)
    set +e
    case "$p" in
        faults)  cargo test --quiet --test faults -- --include-ignored --test-threads=2 ;;
        hostile) HOSTILE_RUNS="${HOSTILE_RUNS:-20}" cargo test --quiet --test hostile -- --include-ignored --nocapture ;;
        soak)    cargo test --quiet --test soak -- --include-ignored --nocapture ;;
        mesh)    cargo test --quiet --test mesh_soak -- --include-ignored --nocapture ;;
        fuzz)    cargo test --quiet --test fuzz -- --include-ignored --nocapture ;;
        *) echo "unknown part $p (faults, hostile, soak, mesh, fuzz)"; false ;;
    esac > "$out/$p-$run.log" 2>&1
    rc=$?
    set -e
    grep -E "^(soak figures|mesh soak figures|fuzz figures|soak: (LEAK|LEFT|unexpected)|hostile run|test result:)" "$out/$p-$run.log" || true
    echo "$p: $([ $rc = 0 ] && echo PASSED || echo FAILED) in $(( $(date +%s) - start )) s (log: $out/$p-$run.log)"
    [ $rc = 0 ] || failed=$((failed + 1))
done
done
[ "$runs" = 1 ] || echo "$failed of $(( runs * ${#parts[@]} )) part runs failed"
echo
echo "leftovers: $(losetup -a | grep -c example-csi-test || true) loop devices, $(grep -c example-csi-test /proc/self/mountinfo || true) mounts of test dirs"
[ "$failed" = 0 ]
