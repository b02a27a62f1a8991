#!/usr/bin/env bash
# Whether batching costs latency anywhere on PostgreSQL, for the choice of `serve`'s default
# batch size there: the natural key end to end (published to JetStream, consumed by the real
# loop, acked after commit), with serve's default lanes (10, its pool size), in batches of 1, 16
# and 64:
#
#   1. at saturation, everything published first: messages per second;
#   2. at 1%, 10% and 50% of the per-message peak of step 1, the same process publishing
#      meanwhile: latency from publish to handled, p50 and p99 (a rate below the one asked means
#      it did not keep up).
#
#   scripts/bench-batch-default.sh [messages at saturation, default 20000] [seconds per paced run, default 20]
#
# Needs the local PostgreSQL (or DATABASE_URL) and NATS (or NATS_URL), jq, and the study binary
# in release: `cargo build --release -p inventory-benches --bins` (INVENTORY_STUDY names another).
set -euo pipefail
cd "$(dirname "$0")/.."

messages=${1:-20000}
seconds=${2:-20}
study=${INVENTORY_STUDY:-target/release/inventory-study}
lanes=10
books=1000

run() { # run <batch> [flags]: one end-to-end run's JSON report
  local batch=$1
  shift
  "$study" bench end-to-end --json --books $books --concurrency $lanes --batch-size "$batch" "$@"
}

echo "1. saturation, $lanes lanes, $messages orders (10% resent under new ids)"
printf '%-8s %12s %14s\n' "batch" "msg/s" "µs CPU/msg"
declare -A peak
for batch in 1 16 64; do
  report=$(run "$batch" --messages "$messages")
  peak[$batch]=$(jq .messages_per_second <<<"$report")
  printf '%-8s %12.0f %14.1f\n' "$batch" "${peak[$batch]}" "$(jq .cpu_micros_per_message <<<"$report")"
done

echo
echo "2. latency, publish to handled, at a share of the per-message peak (${peak[1]%.*} msg/s), $lanes lanes"
printf '%-6s %-8s %10s %10s %10s %10s\n' "load" "batch" "asked" "msg/s" "p50 ms" "p99 ms"
for share in 0.01 0.10 0.50; do
  rate=$(printf '%.0f' "$(echo "${peak[1]} * $share" | bc -l)")
  [ "$rate" -ge 1 ] || rate=1
  for batch in 1 16 64; do
    report=$(run "$batch" --rate "$rate" --messages $(( rate * seconds )))
    printf '%-6s %-8s %10s %10.0f %10.2f %10.2f\n' "$(printf '%.0f%%' "$(echo "$share * 100" | bc -l)")" \
      "$batch" "$rate" "$(jq .messages_per_second <<<"$report")" \
      "$(jq .latency.p50_ms <<<"$report")" "$(jq .latency.p99_ms <<<"$report")"
  done
done
