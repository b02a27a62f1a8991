#!/usr/bin/env bash
# What the cancel guard costs, side by side in one run: pgbench running the placement statement
# (RESERVE_SQL) and the statements that bound it (benches/src/guard_cost.rs) on the same books,
# at 1, 4 and 16 clients, the statements interleaved round by round so that the machine's noise
# falls on all of them alike. Prints each round's tps, the median, and each statement's cost per
# placement relative to the availability check alone; then the WAL each statement writes per
# placement (2,000 placements on one client after 2,000 that warm the pages, pg_current_wal_lsn
# before and after).
#
#   scripts/bench-cancel-guard.sh [seconds per pgbench run, default 10] [rounds, default 3]
#
# It runs on a PostgreSQL cluster of its own (initdb in a temporary directory, default settings,
# a free port), so that no other database's traffic lands in its WAL figures or its server;
# from Debian's postgresql package (as root, the server runs as the postgres user). With
# DATABASE_URL set it uses that server instead, and the WAL figures count the whole server's.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-10}
rounds=${2:-3}
books=1000
statements=(minimal availability availability-event reserve)
dir=$(mktemp -d)
chmod 755 "$dir"
pg_bin=
cleanup() {
  if [ -n "$pg_bin" ]; then own_cluster_stop "$dir/data" immediate 2>/dev/null || true
  elif [ -n "${db:-}" ]; then psql -q "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT
source scripts/own-cluster.sh

if [ -n "${DATABASE_URL:-}" ]; then
  server=$DATABASE_URL
  db="pgbench_guard_$$"
  psql -q "$server" -c "CREATE DATABASE $db" >/dev/null
  url="${server%/*}/$db"
else
  own_cluster_start "$dir/data"
fi

cargo build --release --locked -p inventory-service -p inventory-benches >&2
inventory=${CARGO_TARGET_DIR:-target}/release/inventory

DATABASE_URL="$url" "$inventory" migrate >/dev/null
psql -q "$url" -c "$("$inventory" bench pgbench-script --seed --books $books)" >/dev/null
for statement in "${statements[@]}"; do
  "$inventory" bench pgbench-script --books $books --statement "$statement" >"$dir/$statement.sql"
done

pgbench_tps() {
  local statement=$1 clients=$2 threads=$(( $2 < 2 ? $2 : 2 ))
  pgbench -n -M prepared -f "$dir/$statement.sql" -c "$clients" -j "$threads" -T "$seconds" "$url" 2>/dev/null |
    sed -n 's/^tps = \([0-9.]*\) .*/\1/p'
}

median() { sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

for clients in 1 4 16; do
  for round in $(seq 1 "$rounds"); do
    for statement in "${statements[@]}"; do
      pgbench_tps "$statement" "$clients" >>"$dir/$statement.$clients"
    done
    # Between rounds: the reservations pile up as in production, and autovacuum keeps pace.
    psql -q "$url" -c "VACUUM ANALYZE" >/dev/null
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

printf '\n%-20s %16s\n' "statement" "WAL bytes/placement"
for statement in "${statements[@]}"; do
  # A first run warms the pages, so that the measured one writes no full-page images.
  pgbench -n -M prepared -f "$dir/$statement.sql" -c 1 -t 2000 "$url" >/dev/null 2>&1
  before=$(psql -Atq "$url" -c "SELECT pg_current_wal_lsn()")
  pgbench -n -M prepared -f "$dir/$statement.sql" -c 1 -t 2000 "$url" >/dev/null 2>&1
  bytes=$(psql -Atq "$url" -c "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '$before')")
  printf '%-20s %16.0f\n' "$statement" "$(echo "$bytes / 2000" | bc -l)"
done
