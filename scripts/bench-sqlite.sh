#!/usr/bin/env bash
# SQLite side by side, one run: SQLite's own bound (`inventory bench sqlite-bound`: the SQLite
# handler's statements in a tight loop on a fresh file, no NATS) against the service end to end
# (published to JetStream, consumed by the real loop into a fresh SQLite file, acked after
# commit), a commit per message and per batch of 16 and 64. Prints the ratios.
#
#   scripts/bench-sqlite.sh [messages per run, default 20000] [service lanes, default 2]
#
# Needs NATS (or NATS_URL). The files are made in the temporary directory (TMPDIR).
set -euo pipefail
cd "$(dirname "$0")/.."

messages=${1:-20000}
lanes=${2:-2}
books=1000

cargo build --release --locked -p inventory-service -p inventory-benches >&2
inventory=${CARGO_TARGET_DIR:-target}/release/inventory

# messages_per_second of the report whose batch_size is $2, in the JSON $1.
rate_of() {
  grep -o '{[^}]*}' <<<"$1" | grep "\"batch_size\":$2," |
    sed -n 's/.*"messages_per_second":\([0-9.]*\).*/\1/p'
}

printf '%-8s %-8s %14s %16s %8s\n' "lanes" "batch" "bound msg/s" "service msg/s" "ratio"
for batch in 1 16 64; do
  # Side by side: the fsync a commit waits for varies with the disk's other work, so the bound
  # and the service of one batch size run one right after the other.
  bound=$("$inventory" bench sqlite-bound --json --messages "$messages" --books $books --batch-sizes "$batch")
  service=$("$inventory" bench end-to-end --json --database-url sqlite:// --messages "$messages" \
    --books $books --concurrency "$lanes" --batch-size "$batch")
  rate=$(rate_of "$service" "$batch")
  limit=$(rate_of "$bound" "$batch")
  printf '%-8s %-8s %14.0f %16.0f %8.2f\n' "$lanes" "$batch" "$limit" "$rate" "$(echo "$rate / $limit" | bc -l)"
done
