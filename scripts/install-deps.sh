#!/usr/bin/env bash
# Installs what building and testing example-csi needs, skipping what is there.
set -euo pipefail
# shellcheck source=scripts/preamble.sh
. "$(dirname "$0")/preamble.sh"
need=()
for pair in mkfs.xfs:xfsprogs mkfs.btrfs:btrfs-progs mkfs.ext4:e2fsprogs losetup:mount gdb:gdb \
            findmnt:util-linux blkid:util-linux bc:bc python3:python3 pip3:python3-pip \
            shellcheck:shellcheck; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v go >/dev/null || { echo "Go is required (csi-sanity, the CSI contract check)"; exit 1; }

# gRPC clients other than Go's, for tests/clients.rs: Python grpcio at its
# defaults (grpc C-core) in its own virtualenv, and grpcurl.
GRPC_VENV=/opt/example-csi/grpc-venv
GRPCIO_VERSION=1.85.1
GRPCURL_VERSION=v1.9.4
if ! "$GRPC_VENV/bin/python" -c "import grpc, grpc_tools, sys; sys.exit(grpc.__version__ != '$GRPCIO_VERSION')" 2>/dev/null; then
  echo "installing grpcio $GRPCIO_VERSION and grpcio-tools in $GRPC_VENV"
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3-venv >/dev/null
  fi
  rm -rf "$GRPC_VENV"
  python3 -m venv "$GRPC_VENV"
  "$GRPC_VENV/bin/pip" install --quiet --disable-pip-version-check \
    "grpcio==$GRPCIO_VERSION" "grpcio-tools==$GRPCIO_VERSION"
fi
gobin="$(go env GOBIN)"; [ -n "$gobin" ] || gobin="$(go env GOPATH)/bin"
# `go install` leaves grpcurl's own -version unset; the module version is in the binary.
if ! go version -m "$gobin/grpcurl" 2>/dev/null | grep -Eq "^\s+mod\s+github.com/fullstorydev/grpcurl\s+$GRPCURL_VERSION\s"; then
  echo "installing grpcurl $GRPCURL_VERSION"
  (cd "${TMPDIR:-/tmp}" && go install "github.com/fullstorydev/grpcurl/cmd/grpcurl@$GRPCURL_VERSION")
fi
command -v cargo >/dev/null || { echo "Rust (cargo) is required"; exit 1; }
# The check that every crate uses each dependency it names (test-all.sh).
CARGO_MACHETE_VERSION=0.9.2
if [ "$(cargo machete --version 2>/dev/null)" != "$CARGO_MACHETE_VERSION" ]; then
  echo "installing cargo-machete $CARGO_MACHETE_VERSION"
  cargo install --quiet --locked cargo-machete --version "$CARGO_MACHETE_VERSION"
fi
if command -v rustup >/dev/null; then
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"
  done
fi
# cargo deny (scripts/deny.sh): built from crates.io once, about ten minutes
# on two cores; kept in ~/.cargo/bin afterwards.
CARGO_DENY_VERSION=0.20.2
if ! cargo deny --version 2>/dev/null | grep -qx "cargo-deny $CARGO_DENY_VERSION"; then
  echo "installing cargo-deny $CARGO_DENY_VERSION"
  nice cargo install --locked --quiet cargo-deny --version "$CARGO_DENY_VERSION"
fi
echo "dependencies present"
