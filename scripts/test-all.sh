#!/usr/bin/env bash
# Runs every test of example-csi: formatting, lints and unused dependencies, the
# Rust unit and integration tests (real loop devices, mkfs and mounts: run as root), the CSI
# contract check, csi-sanity in every configuration, the deploy/ validation, the
# cluster benchmark client's own tests, and the end-to-end scenarios on a real
# Kubernetes: the central flavor on one node, then the cluster flavor (the
# default deployment) on two kubelets.
# Installs what is missing first, so it works on a fresh machine.
#
# The tests that need root are marked #[ignore = "needs root: ..."], so that a
# plain `cargo test` by a normal user reports them as ignored; this script runs
# them all with `-- --include-ignored`, and counts a test still ignored as failed.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "scripts/test-all.sh needs root (loop devices, mkfs, mounts)" >&2; exit 1; }
cd "$(dirname "$0")/.."
# shellcheck source=scripts/preamble.sh
. scripts/preamble.sh
log=$(mktemp /tmp/example-csi-test.XXXXXX)
results=$(mktemp -d /tmp/example-csi-results.XXXXXX)
prebuild_log=$(mktemp /tmp/example-csi-e2e-build.XXXXXX)
prebuild=""
cleanup() {
    [ -n "$prebuild" ] && kill -- "-$prebuild" 2>/dev/null
    rm -rf "$log" "$results" "$prebuild_log"
}
trap cleanup EXIT

# count FILE KEY: the number KEY of the JSON a step wrote (empty without one).
count() {
    python3 -c 'import json, sys
try:
    print(int(json.load(open(sys.argv[1]))[sys.argv[2]]))
except (OSError, ValueError, KeyError):
    pass' "$1" "$2"
}

step() { echo; echo "==== $* (at $(( SECONDS / 60 )) min)"; }

step "dependencies"
scripts/install-deps.sh

# The end-to-end test's Go builds (Kubernetes, etcd, the sidecars: about half an
# hour on a fresh 2-core machine, nothing once cached) run beside the Rust tests
# at the lowest priority, which mostly wait on the disk; the e2e step waits for
# them. In its own process group, so that an interrupted run stops them.
if ! bash e2e/build.sh --check >/dev/null 2>&1; then
    echo "building the end-to-end test's components in the background (log: $prebuild_log)"
    set -m
    nice -n 19 bash e2e/build.sh >"$prebuild_log" 2>&1 &
    prebuild=$!
    set +m
fi

step "format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

step "sizes: no production function over 80 lines, no file over 800"
cargo clippy --workspace --lib --bins --quiet -- -D warnings -W clippy::too_many_lines
long=$(git ls-files '*.rs' | grep -v -e '^tests/' -e '/tests/' -e 'tests\.rs$' -e '^deny/' |
    xargs wc -l | awk '$2 != "total" && $1 > 800')
[ -z "$long" ] || { echo "production files over 800 lines:"; echo "$long"; exit 1; }

step "dependencies: advisories, licenses, bans, sources (cargo deny)"
scripts/deny.sh

step "unused dependencies"
cargo machete

step "shell scripts (shellcheck)"
# shellcheck disable=SC2046
shellcheck -S warning $(git ls-files '*.sh')

step "the cluster benchmark's breakdown of a claim's way (Python unittest, no cluster)"
python3 -m unittest discover -s e2e/lib -p 'test_*.py'

step "build"
cargo build --workspace --all-targets --quiet

step "cargo test (unit, integration, CSI contract)"
set +e
cargo test --workspace --no-fail-fast -- --include-ignored 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
cargo_passed=$(grep -E "^test result:" "$log" | sed -E 's/.* ([0-9]+) passed.*/\1/' | paste -sd+ | bc)
cargo_failed=$(grep -E "^test result:" "$log" | sed -E 's/.* ([0-9]+) failed.*/\1/' | paste -sd+ | bc)
cargo_ignored=$(grep -E "^test result:" "$log" | sed -E 's/.* ([0-9]+) ignored.*/\1/' | paste -sd+ | bc)
if [ "${cargo_ignored:-0}" != 0 ]; then
    echo "cargo test: ${cargo_ignored} tests were not run"
    cargo_failed=$(( ${cargo_failed:-0} + cargo_ignored ))
fi
[ "$rc" -ne 0 ] && [ "${cargo_failed:-0}" = 0 ] && cargo_failed=1
[ "$rc" -ne 0 ] && { echo "cargo test failed"; }

step "csi-sanity"
set +e
RESULT_JSON="$results/csi-sanity.json" CSI_DRIVER_BIN="$PWD/target/debug/csi-driver" csi-sanity/run.sh
src=$?
set -e
sanity_passed=$(count "$results/csi-sanity.json" passed)
sanity_failed=$(count "$results/csi-sanity.json" failed)
[ "$src" -ne 0 ] && [ "${sanity_failed:-0}" = 0 ] && sanity_failed=1

step "deploy/ manifests"
set +e
CSI_DRIVER_BIN="$PWD/target/debug/csi-driver" bash deploy/validate.sh 2>&1 | tee "$log"
drc=${PIPESTATUS[0]}
set -e
deploy_failed=0; [ "$drc" -ne 0 ] && deploy_failed=1

step "end-to-end on a real Kubernetes (e2e/run.sh --flavor central --flavor cluster)"
set +e
if [ -n "$prebuild" ]; then
    wait "$prebuild" || { echo "the background build failed; e2e/run.sh builds what is missing:"; tail -20 "$prebuild_log"; }
    prebuild=""
fi
# central covers what only it deploys (changed block tracking); cluster, the
# default deployment, every other scenario on two nodes and the volumes that
# move between them.
RESULT_JSON="$results/e2e.json" e2e/run.sh --flavor central --flavor cluster
erc=$?
set -e
e2e_passed=$(count "$results/e2e.json" passed)
e2e_failed=$(count "$results/e2e.json" failed)
[ "$erc" -ne 0 ] && [ "${e2e_failed:-0}" = 0 ] && e2e_failed=1

passed=$(( ${cargo_passed:-0} + ${sanity_passed:-0} + ${e2e_passed:-0} ))
failed=$(( ${cargo_failed:-0} + ${sanity_failed:-0} + deploy_failed + ${e2e_failed:-0} ))
echo
echo "cargo test: ${cargo_passed:-0} passed, ${cargo_failed:-0} failed; csi-sanity: ${sanity_passed:-0} passed, ${sanity_failed:-0} failed; deploy checks: $([ $deploy_failed = 0 ] && echo ok || echo FAILED); e2e: ${e2e_passed:-0} passed, ${e2e_failed:-0} failed"
echo "total: $passed passed, $failed failed (in $(( SECONDS / 60 )) min)"
[ "$failed" = 0 ]
