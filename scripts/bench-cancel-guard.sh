#!/usr/bin/env bash
# What the cancel guard costs, side by side in one run: pgbench running the placement statement
# (RESERVE_SQL) and the statements that bound it (benches/src/guard_cost.rs) on the same books,
# at 1, 4 and 16 clients, the statements interleaved round by round so that the machine's noise
# falls on all of them alike. Prints each round's tps, the median, and each statement's cost per
# placement relative to the availability check alone.
#
#   scripts/bench-cancel-guard.sh [seconds per pgbench run, default 10] [rounds, default 3]
#
# Needs the local PostgreSQL (or DATABASE_URL naming a server).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-10}
rounds=${2:-3}
server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
books=1000
statements=(minimal availability availability-event reserve)

cargo build --release --locked -p inventory-service -p inventory-benches >&2
inventory=${CARGO_TARGET_DIR:-target}/release/inventory

db="pgbench_guard_$$"
base=${server%/*}
dir=$(mktemp -d)
cleanup() { psql -q "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true; rm -rf "$dir"; }
trap cleanup EXIT
psql -q "$server" -c "CREATE DATABASE $db" >/dev/null
DATABASE_URL="$base/$db" "$inventory" migrate >/dev/null
psql -q "$base/$db" -c "$("$inventory" bench pgbench-script --seed --books $books)" >/dev/null
for statement in "${statements[@]}"; do
  "$inventory" bench pgbench-script --books $books --statement "$statement" >"$dir/$statement.sql"
done

pgbench_tps() {
  local statement=$1 clients=$2 threads=$(( $2 < 2 ? $2 : 2 ))
  pgbench -n -M prepared -f "$dir/$statement.sql" -c "$clients" -j "$threads" -T "$seconds" "$base/$db" 2>/dev/null |
    sed -n 's/^tps = \([0-9.]*\) .*/\1/p'
}

median() { sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

for clients in 1 4 16; do
  for round in $(seq 1 "$rounds"); do
    for statement in "${statements[@]}"; do
      pgbench_tps "$statement" "$clients" >>"$dir/$statement.$clients"
    done
    # Between rounds: the reservations pile up as in production, and autovacuum keeps pace.
    psql -q "$base/$db" -c "VACUUM ANALYZE" >/dev/null
  done
done

printf '%-20s %-8s %-28s %10s %22s\n' "statement" "clients" "tps per round" "median" "cost vs availability"
for clients in 1 4 16; do
  bound=$(median <"$dir/availability.$clients")
  for statement in "${statements[@]}"; do
    tps=$(median <"$dir/$statement.$clients")
    printf '%-20s %-8s %-28s %10.0f %+21.1f%%\n' "$statement" "$clients" \
      "$(paste -sd' ' "$dir/$statement.$clients" | xargs printf '%.0f ')" "$tps" \
      "$(echo "($bound / $tps - 1) * 100" | bc -l)"
  done
done
