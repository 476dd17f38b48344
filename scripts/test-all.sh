#!/usr/bin/env bash
# Runs every test of example-csi: formatting and lints, the Rust unit and
# integration tests (real loop devices, mkfs and mounts: run as root), the CSI
# contract check, csi-sanity in every configuration, the deploy/ validation, and
# the end-to-end scenarios on a real single-node Kubernetes (central flavor).
# Installs what is missing first, so it works on a fresh machine.
#
# The tests that need root are marked #[ignore = "needs root: ..."], so that a
# plain `cargo test` by a normal user reports them as ignored; this script runs
# them all with `-- --include-ignored`, and counts a test still ignored as failed.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "scripts/test-all.sh needs root (loop devices, mkfs, mounts)" >&2; exit 1; }
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/go/bin:$HOME/go/bin:/root/go/bin:/usr/sbin:/sbin:$HOME/.cargo/bin"
log=$(mktemp /tmp/example-csi-test.XXXXXX)
trap 'rm -f "$log"' EXIT

step() { echo; echo "==== $*"; }

step "dependencies"
scripts/install-deps.sh

step "format and lints"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings

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
CSI_DRIVER_BIN="$PWD/target/debug/csi-driver" csi-sanity/run.sh 2>&1 | tee "$log"
src=${PIPESTATUS[0]}
set -e
sanity_passed=$(grep -E "^csi-sanity: [0-9]+ passed" "$log" | sed -E 's/^csi-sanity: ([0-9]+) passed.*/\1/')
sanity_failed=$(grep -E "^csi-sanity: [0-9]+ passed" "$log" | sed -E 's/.* ([0-9]+) failed.*/\1/')
[ "$src" -ne 0 ] && [ "${sanity_failed:-0}" = 0 ] && sanity_failed=1

step "deploy/ manifests"
set +e
CSI_DRIVER_BIN="$PWD/target/debug/csi-driver" bash deploy/validate.sh 2>&1 | tee "$log"
drc=${PIPESTATUS[0]}
set -e
deploy_failed=0; [ "$drc" -ne 0 ] && deploy_failed=1

step "end-to-end on a real Kubernetes (e2e/run.sh --flavor central)"
set +e
e2e/run.sh --flavor central 2>&1 | tee "$log"
erc=${PIPESTATUS[0]}
set -e
e2e_passed=$(grep -E "^e2e .*: [0-9]+ passed" "$log" | sed -E 's/.*: ([0-9]+) passed.*/\1/')
e2e_failed=$(grep -E "^e2e .*: [0-9]+ passed" "$log" | sed -E 's/.* ([0-9]+) failed.*/\1/')
[ "$erc" -ne 0 ] && [ "${e2e_failed:-0}" = 0 ] && e2e_failed=1

passed=$(( ${cargo_passed:-0} + ${sanity_passed:-0} + ${e2e_passed:-0} ))
failed=$(( ${cargo_failed:-0} + ${sanity_failed:-0} + deploy_failed + ${e2e_failed:-0} ))
echo
echo "cargo test: ${cargo_passed:-0} passed, ${cargo_failed:-0} failed; csi-sanity: ${sanity_passed:-0} passed, ${sanity_failed:-0} failed; deploy checks: $([ $deploy_failed = 0 ] && echo ok || echo FAILED); e2e: ${e2e_passed:-0} passed, ${e2e_failed:-0} failed"
echo "total: $passed passed, $failed failed"
[ "$failed" = 0 ]
