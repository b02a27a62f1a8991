#!/usr/bin/env bash
# Side by side, one run, every ratio of the PostgreSQL path against its own bound:
#
#   1. per message: pgbench running the handler's own SQL (RESERVE_SQL on one placement) against
#      the service end to end (published to JetStream, consumed by the real loop, acked after
#      commit), at 1, 4 and 16 in flight; and PostgreSQL's own bound beside pgbench (`inventory
#      bench postgres-bound`: the same statement on the service's workload, its values bound as
#      the lanes bind them, where pgbench's script computes its uuids in the statement);
#   2. CPU per message of the service process against the hand-written consumer of the same
#      statement (`inventory bench hand-written`: tokio-postgres + async-nats) at 1, 4 and 16,
#      and against the same loop on sqlx (`--driver sqlx`), which parts the driver's share;
#   3. batched: pgbench running the same statement (RESERVE_SQL on arrays of 16 and 64
#      placements, 16 clients, each on books of its own as the lanes are) and the bound of step 1
#      on batches against `end-to-end --batch-size 16/64 --concurrency 16`;
#   4. the latency batching adds: publish to handled, p50/p99, per message and in batches of 16
#      and 64, at half the per-message peak (the service's rate at 16 in flight in step 1), the
#      same process publishing meanwhile (a rate below the one asked: it did not keep up).
#
#   scripts/bench-vs-pgbench.sh [seconds per pgbench run, default 15] [messages per service run, default 20000]
#
# Needs the local PostgreSQL (or DATABASE_URL naming a server), NATS (or NATS_URL), pgbench,
# psql and jq. About eight minutes with the defaults, once built.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-15}
messages=${2:-20000}
server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
books=1000

cargo build --release --locked -p inventory-service -p inventory-benches >&2
inventory=${CARGO_TARGET_DIR:-target}/release/inventory

db="pgbench_reserve_$$"
base=${server%/*}
dir=$(mktemp -d)
cleanup() { psql -q "$server" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 || true; rm -rf "$dir"; }
trap cleanup EXIT
psql -q "$server" -c "CREATE DATABASE $db" >/dev/null
DATABASE_URL="$base/$db" "$inventory" migrate >/dev/null
psql -q "$base/$db" -c "$("$inventory" bench pgbench-script --seed --books $books)" >/dev/null
"$inventory" bench pgbench-script --books $books >"$dir/one.sql"
for batch in 16 64; do
  "$inventory" bench pgbench-script --books $books --batch-size $batch >"$dir/batch$batch.sql"
done

# Statements per second of script $1 on $2 clients.
pgbench_tps() {
  local script=$1 clients=$2 threads=$(( $2 < 2 ? $2 : 2 ))
  pgbench -n -M prepared -f "$script" -c "$clients" -j "$threads" -T "$seconds" "$base/$db" 2>/dev/null |
    sed -n 's/^tps = \([0-9.]*\) .*/\1/p'
}

# One end-to-end run's JSON report: bench_json <command> <in flight> <batch> [more flags].
bench_json() {
  local command=$1 in_flight=$2 batch=$3
  shift 3
  "$inventory" bench "$command" --json --books $books --concurrency "$in_flight" --batch-size "$batch" "$@"
}

ratio() { echo "$1 / $2" | bc -l; }

# Messages per second of PostgreSQL's own bound: bound_rate <in flight> <batch> <messages>.
bound_rate() {
  bench_json postgres-bound "$1" "$2" --messages "$3" | jq '.[0].messages_per_second'
}

echo "1. per message: the service against pgbench running RESERVE_SQL and against PostgreSQL's own bound"
printf '%-10s %14s %14s %14s %8s %8s\n' "in flight" "pgbench msg/s" "bound msg/s" "service msg/s" "÷ pgb." "÷ bound"
declare -A service_cpu
peak=0
for clients in 1 4 16; do
  tps=$(pgbench_tps "$dir/one.sql" "$clients")
  bound=$(bound_rate "$clients" 1 "$messages")
  report=$(bench_json end-to-end "$clients" 1 --messages "$messages")
  rate=$(jq .messages_per_second <<<"$report")
  service_cpu[$clients]=$(jq '[.cpu_micros_per_message, .cpu_user_seconds, .cpu_system_seconds, .messages] | @tsv' -r <<<"$report")
  printf '%-10s %14.0f %14.0f %14.0f %8.2f %8.2f\n' "$clients" "$tps" "$bound" "$rate" \
    "$(ratio "$rate" "$tps")" "$(ratio "$rate" "$bound")"
  peak=$rate
done

echo
echo "2. CPU per message of the whole process while consuming: the service against the hand-written consumer,"
echo "   on tokio-postgres (the bound) and on sqlx (the service's driver: what is left is the service's own loop)"
printf '%-10s %18s %18s %8s %18s %8s\n' "in flight" "service µs (u/s)" "hand µs (u/s)" "ratio" "hand sqlx µs (u/s)" "ratio"
# "total (user/system)" µs per message of a report.
cpu() { jq -r '"\(.cpu_micros_per_message) \(.cpu_user_seconds * 1e6 / .messages) \(.cpu_system_seconds * 1e6 / .messages)"' <<<"$1"; }
for clients in 1 4 16; do
  read -r h_total h_user h_system <<<"$(cpu "$(bench_json hand-written "$clients" 1 --messages "$messages")")"
  read -r q_total q_user q_system <<<"$(cpu "$(bench_json hand-written "$clients" 1 --messages "$messages" --driver sqlx)")"
  read -r s_total s_user s_system s_messages <<<"${service_cpu[$clients]}"
  printf '%-10s %6.1f (%4.1f/%4.1f) %6.1f (%4.1f/%4.1f) %8.2f %6.1f (%4.1f/%4.1f) %8.2f\n' "$clients" \
    "$s_total" "$(echo "$s_user * 1000000 / $s_messages" | bc -l)" "$(echo "$s_system * 1000000 / $s_messages" | bc -l)" \
    "$h_total" "$h_user" "$h_system" "$(ratio "$s_total" "$h_total")" \
    "$q_total" "$q_user" "$q_system" "$(ratio "$s_total" "$q_total")"
done

echo
echo "3. batched, 16 in flight: the service against pgbench running RESERVE_SQL on arrays of the same size,"
echo "   and against PostgreSQL's own bound on batches of the same size"
printf '%-8s %14s %14s %14s %8s %8s %12s\n' "batch" "pgbench msg/s" "bound msg/s" "service msg/s" "÷ pgb." "÷ bound" "service µs"
for batch in 16 64; do
  pgbench_rate=$(echo "$(pgbench_tps "$dir/batch$batch.sql" 16) * $batch" | bc -l)
  bound=$(bound_rate 16 "$batch" $(( messages * 4 )))
  report=$(bench_json end-to-end 16 "$batch" --messages $(( messages * 4 )))
  rate=$(jq .messages_per_second <<<"$report")
  printf '%-8s %14.0f %14.0f %14.0f %8.2f %8.2f %12.1f\n' "$batch" "$pgbench_rate" "$bound" "$rate" \
    "$(ratio "$rate" "$pgbench_rate")" "$(ratio "$rate" "$bound")" "$(jq .cpu_micros_per_message <<<"$report")"
done

echo
half=$(printf '%.0f' "$(echo "$peak / 2" | bc -l)")
echo "4. latency, publish to handled, at $half msg/s (half the per-message peak at 16 in flight), 16 in flight"
printf '%-8s %10s %10s %10s %10s\n' "batch" "msg/s" "p50 ms" "p99 ms" "max ms"
for batch in 1 16 64; do
  report=$(bench_json end-to-end 16 "$batch" --rate "$half" --messages $(( half * 10 )))
  printf '%-8s %10.0f %10.1f %10.1f %10.1f\n' "$batch" "$(jq .messages_per_second <<<"$report")" \
    "$(jq .latency.p50_ms <<<"$report")" "$(jq .latency.p99_ms <<<"$report")" "$(jq .latency.max_ms <<<"$report")"
done
