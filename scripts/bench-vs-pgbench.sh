#!/usr/bin/env bash
# Side by side, one run: PostgreSQL alone (pgbench running the one-statement handler's own SQL)
# against the service end to end (published to JetStream, consumed by the real loop, acked after
# commit), at 1, 4 and 16 in flight; then the batched mode at 16. Prints the ratios.
#
#   scripts/bench-vs-pgbench.sh [seconds per pgbench run, default 15] [messages per service run, default 20000]
#
# Needs the local PostgreSQL (or DATABASE_URL naming a server) and NATS (or NATS_URL).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-15}
messages=${2:-20000}
server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
books=1000

cargo build --release --locked -p inventory-service -p inventory-benches >&2
inventory=target/release/inventory

db="pgbench_reserve_$$"
base=${server%/*}
cleanup() { psql -q "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true; rm -f "$script"; }
script=$(mktemp --suffix=.sql)
trap cleanup EXIT
psql -q "$server" -c "CREATE DATABASE $db" >/dev/null
DATABASE_URL="$base/$db" "$inventory" migrate >/dev/null
psql -q "$base/$db" -c "$("$inventory" bench pgbench-script --seed --books $books)" >/dev/null
"$inventory" bench pgbench-script --books $books >"$script"

pgbench_tps() {
  local clients=$1 threads=$(( $1 < 2 ? $1 : 2 ))
  pgbench -n -M prepared -f "$script" -c "$clients" -j "$threads" -T "$seconds" "$base/$db" 2>/dev/null |
    sed -n 's/^tps = \([0-9.]*\) .*/\1/p'
}

service_rate() {
  "$inventory" bench end-to-end --json --messages "$messages" --books $books --concurrency "$1" --batch-size "$2" |
    sed -n 's/.*"messages_per_second":\([0-9.]*\).*/\1/p'
}

printf '%-10s %-8s %14s %16s %8s\n' "in flight" "batch" "pgbench msg/s" "service msg/s" "ratio"
for clients in 1 4 16; do
  tps=$(pgbench_tps "$clients")
  rate=$(service_rate "$clients" 1)
  printf '%-10s %-8s %14.0f %16.0f %8.2f\n' "$clients" 1 "$tps" "$rate" "$(echo "$rate / $tps" | bc -l)"
done
tps=$(pgbench_tps 16)
for batch in 16 64; do
  rate=$(service_rate 16 "$batch")
  printf '%-10s %-8s %14.0f %16.0f %8.2f\n' 16 "$batch" "$tps" "$rate" "$(echo "$rate / $tps" | bc -l)"
done
