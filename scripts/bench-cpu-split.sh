#!/usr/bin/env bash
# Where the two cores go, per message, for each mode: the whole machine's CPU during the
# consumption of one workload, by process (the consumer, nats-server, PostgreSQL with every
# backend, the rest of the machine), from /proc at the consumer's start and its last ack
# (`inventory bench end-to-end` reports it as `cpu_split`). Modes: PostgreSQL and SQLite, one
# message per transaction at 16 in flight and batches of up to 64 at serve's default lanes, the
# service and the hand-written sqlx loop of the same statements. Neither runs the relay.
#
# With --components (needs perf), each consumer's own part by component as well, the service's
# beside the loop's: one more run of each per mode under `perf record` (DWARF call stacks),
# each sample given to the first of these its stack holds, in this order: logging (tracing),
# decoding (serde_json), the driver (sqlx, sea-orm), the NATS client (fetch, acks), the relay,
# the consumer's own code, the runtime (tokio); a syscall goes to the component that made it.
# The samples of the benchmark's publisher, which runs before the consumer, are left out; the
# shares are applied to the µs per message of the runs without perf.
#
#   scripts/bench-cpu-split.sh [--components] [messages per run, default 20000] [rounds, default 2]
#
# Needs the local PostgreSQL (or DATABASE_URL), NATS (or NATS_URL) and jq. Builds the release
# study binary, unless INVENTORY_BIN names one.
set -eEuo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

components=false
if [ "${1:-}" = --components ]; then
  components=true
  shift
fi
messages=${1:-20000}
rounds=${2:-2}
# shellcheck source=scripts/side-by-side.sh
. scripts/side-by-side.sh

# A mode: backend, lanes (`serve` for serve's default), batch size.
modes=("postgres 16 1" "postgres serve 64" "sqlite 16 1" "sqlite serve 64")

# Each consumer's own µs per message per mode, summed over the rounds, for the components.
declare -A consumer_cpu
printf '| mode | consumer | msg/s | consumer µs/msg | nats-server | PostgreSQL | rest of the machine | machine |\n'
printf '| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n'
for round in $(seq 1 "$rounds"); do
  for k in "${!modes[@]}"; do
    read -r backend n batch <<<"${modes[$k]}"
    [ "$n" = serve ] && n=${lanes[$backend]}
    if (((round + k) % 2)); then order=(service loop); else order=(loop service); fi
    for consumer in "${order[@]}"; do
      report=$(run "$consumer" "$backend" "$n" "$batch")
      consumer_cpu[$k,$consumer]=$(jq -r --arg sum "${consumer_cpu[$k,$consumer]:-0}" \
        '.cpu_split.this_process + ($sum | tonumber)' <<<"$report")
      jq -r --arg mode "$backend, $n in flight, batch $batch" --arg consumer "$consumer" \
          '"| \($mode) | \($consumer) | \(.messages_per_second | round) | \(.cpu_split | [.this_process, .nats_server, .postgres, .rest, .machine] | map(round | tostring) | join(" | ")) |"' \
          <<<"$report"
    done
  done
done

$components || exit 0

# Each consumer's samples by component: perf script's stacks, one frame a line (the innermost
# first), a blank line after each sample. A sample goes to the innermost frame of a component,
# so a statement's socket write is the driver's and a log event inside the driver is logging;
# the runtime (tokio) and span wrappers around whole futures count only where nothing else does.
by_component() {
  awk '
    function component(frame) {
      if (frame ~ /tracing_core::|tracing_subscriber::|tracing::span::|tracing::event|tracing_log/) return "logging and spans (tracing)"
      if (frame ~ /serde_json::|serde::de::/) return "decoding (serde_json)"
      if (frame ~ /sqlx|sea_orm|sea_query/) return "the driver (sqlx, sea-orm)"
      if (frame ~ /async_nats::/) return "the NATS client (fetch, acks)"
      if (frame ~ /inventory_infra::outbox/) return "the relay"
      if (frame ~ /inventory_(infra|domain|service|benches)/) return "the consumer'"'"'s own code"
      return ""
    }
    function count_sample(   i, c) {
      if (frames == 0) return
      total++
      if (stack ~ /bench_e2e::publish|OrderPublisher/) { publisher++; return }
      for (i = 1; i <= frames; i++) if ((c = component(frame[i])) != "") { count[c]++; return }
      if (stack ~ /tokio::|mio::/) count["the runtime (tokio)"]++
      else count["unattributed (stack cut short, or libc and kernel only)"]++
    }
    /^[[:space:]]+[0-9a-f]+ / { frame[++frames] = $2; stack = stack " " $2; next }
    /^$/ { count_sample(); frames = 0; stack = ""; next }
    END {
      count_sample()
      # The publisher ran before the consumer started: its samples are not the consumer'"'"'s.
      total -= publisher
      for (c in count) printf "%s\t%.1f\n", c, 100 * count[c] / total
    }'
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '\n| mode | component | service µs/msg | loop µs/msg | service − loop |\n'
printf '| --- | --- | ---: | ---: | ---: |\n'
for k in "${!modes[@]}"; do
  read -r backend n batch <<<"${modes[$k]}"
  [ "$n" = serve ] && n=${lanes[$backend]}
  for consumer in service loop; do
    # The µs per message of the runs above (perf's own unwinding inflates this run's).
    cpu=$(awk -v sum="${consumer_cpu[$k,$consumer]}" -v rounds="$rounds" 'BEGIN { print sum / rounds }')
    run $consumer "$backend" "$n" "$batch" perf record -q -F 499 --call-graph dwarf,16384 \
      -o "$work/perf.data" >/dev/null
    perf script -i "$work/perf.data" -F ip,sym 2>/dev/null | by_component |
      awk -F'\t' -v cpu="$cpu" '{ printf "%s\t%.1f\n", $1, cpu * $2 / 100 }' >"$work/$consumer"
  done
  awk -F'\t' -v mode="$backend, $n in flight, batch $batch" '
    FNR == NR { service[$1] = $2; seen[$1] = 1; next }
    { loop[$1] = $2; seen[$1] = 1 }
    END {
      for (c in seen) printf "| %s | %s | %.1f | %.1f | %+.1f |\n", mode, c, service[c], loop[c], service[c] - loop[c]
    }' "$work/service" "$work/loop" | sort -t'|' -k6 -gr
done
