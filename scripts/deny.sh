#!/usr/bin/env bash
# cargo deny (advisories, bans, licenses, sources; deny.toml) on the workspace.
# The RustSec advisory database is fetched when it can be; where it cannot (a
# machine without access to it), the check runs on deny/advisory-db, a copy
# of the database's crates/ folder (CC0-1.0), and says so with its date.
#   scripts/deny.sh                 check
#   scripts/deny.sh --refresh DIR   replace deny/advisory-db with the crates/
#                                   folder of a checkout of the database at DIR
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
vendored=deny/advisory-db
# cargo deny keeps the database of deny.toml's db-urls under db-path, in a
# folder named after the URL.
db=target/advisory-db/advisory-db-3157b0e258782691

if [ "${1:-}" = --refresh ]; then
  full=${2:?usage: $0 --refresh DIR}
  rm -rf "$vendored/crates" && mkdir -p "$vendored"
  cp -r "$full/crates" "$vendored/crates"
  git -C "$full" log -1 --format=%cI > "$vendored/SNAPSHOT" 2>/dev/null || date -u +%FT%TZ > "$vendored/SNAPSHOT"
  exit 0
fi

cargo fetch --locked --quiet
if timeout 120 cargo deny --locked fetch db >/dev/null 2>&1; then
  echo "cargo deny: the advisory database was fetched"
  exec cargo deny --locked check
fi
# Offline: the vendored entries, as a git repository dated like the snapshot
# they come from (cargo deny reads the database's date from its HEAD).
when=$(cat "$vendored/SNAPSHOT")
rm -rf "$db" && mkdir -p "$db"
cp -r "$vendored/crates" "$db/"
git -C "$db" init -q
git -C "$db" add -A
GIT_AUTHOR_DATE=$when GIT_COMMITTER_DATE=$when \
  git -C "$db" -c user.name=deny -c user.email=deny@localhost commit -q -m "advisories of $when"
echo "cargo deny: the advisory database cannot be fetched here; checking against deny/advisory-db ($when)"
exec cargo deny --locked --offline check
