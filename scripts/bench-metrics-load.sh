#!/usr/bin/env bash
# What a flood of /metrics scrapes costs the node's CSI calls: csi-bench's node
# scenario (NodeStage+NodePublish, NodeUnpublish+NodeUnstage of image and dir
# volumes) on one driver, quiet and then beside --metrics-hammer clients, each
# opening a connection per scrape. Usage (root):
#   scripts/bench-metrics-load.sh OUT [CLIENTS] [ROUNDS]
# CSI_DRIVER_BIN and CSI_BENCH_BIN name the binaries (default: target/release,
# built if missing). Everything it makes is torn down on exit.
set -euo pipefail
out=${1:?usage: $0 OUT [CLIENTS] [ROUNDS]}
clients=${2:-300}
rounds=${3:-3}
# shellcheck source=scripts/bench-lib.sh
source "$(dirname "$0")/bench-lib.sh" metrics-load
mkdir -p "$work/pool" "$out"
truncate -s 16G "$work/pool.img"
mkfs.xfs -q -m reflink=1 "$work/pool.img"
mount -o loop "$work/pool.img" "$work/pool"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for load in quiet hammer; do
  rm -rf "$work/state" "$work/scratch" && mkdir -p "$work/state" "$work/scratch"
  extra=()
  [ "$load" = hammer ] && extra=(--metrics-hammer "127.0.0.1:$port" --metrics-hammer-connections "$clients")
  "$bench" --scenarios node --rounds "$rounds" --node-volumes 30 --no-settle \
    --a-name csi-driver --a-endpoint "unix://$work/csi.sock" \
    --a-start "$driver --endpoint unix://$work/csi.sock --nodeid bench-node --pool default=$work/pool --state-dir $work/state --allowed-path-root $work/scratch --metrics-address 127.0.0.1:$port --log-level warn" \
    --scratch "$work/scratch" --out "$out/$load" "${extra[@]}"
done
echo "== quiet"; grep -i "node/" "$out/quiet/results.txt" || true
echo "== beside $clients scraping clients"; grep -i "node/" "$out/hammer/results.txt" || true
cat "$out/hammer/hammer.txt"
