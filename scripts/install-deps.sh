#!/usr/bin/env bash
# Installs what building and testing example-csi needs, skipping what is there.
set -euo pipefail
export PATH="$PATH:/usr/local/go/bin:$HOME/.cargo/bin:/usr/sbin:/sbin"
need=()
for pair in mkfs.xfs:xfsprogs mkfs.btrfs:btrfs-progs mkfs.ext4:e2fsprogs losetup:mount \
            findmnt:util-linux blkid:util-linux bc:bc python3:python3 pip3:python3-pip; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v go >/dev/null || { echo "Go is required (csi-sanity, the CSI contract check)"; exit 1; }
command -v cargo >/dev/null || { echo "Rust (cargo) is required"; exit 1; }
if command -v rustup >/dev/null; then
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"
  done
fi
echo "dependencies present"
