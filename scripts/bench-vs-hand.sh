#!/usr/bin/env bash
# The service against a consumer written by hand on the service's own driver (sqlx) doing the
# same work: the service's statements (the outbox row included), the same batches, the same acks
# after the commit (benches/src/bench_hand/). For each backend (PostgreSQL, SQLite) and each
# configuration (one message per transaction at 1, 4 and 16 in flight; batches of up to 16 and
# 64 at serve's default lanes: 10 on PostgreSQL, its pool size, 2 on SQLite),
# `inventory bench end-to-end` (the service's loop) and `inventory bench hand-written --driver
# sqlx` run one right after the other on the same workload, each on a fresh database or SQLite
# file and streams of its own, in interleaved rounds: which of the two goes first alternates
# from round to round and from configuration to configuration. Prints, per round, service ÷ loop
# for messages per second (goal: at least 0.9) and for CPU µs per message of the whole process
# (goal: at most 1.1); each run's figures, user and system time apart, go to stderr as they come.
#
#   scripts/bench-vs-hand.sh [messages per run, default 20000] [rounds, default 3] [configurations]
#
# configurations: which to run, as backend:lanes×batch words, lanes `serve` for serve's default;
# default all: "postgres:1x1 postgres:4x1 postgres:16x1 postgres:servex16 postgres:servex64"
# and the same on sqlite.
#
# Needs the local PostgreSQL (or DATABASE_URL, a postgres:// URL whose user may create
# databases), NATS (or NATS_URL) and jq. Builds the release study binary, unless INVENTORY_BIN
# names one (`inventory-study`, or `inventory` with the study beside it: both run `bench …`).
set -eEuo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

messages=${1:-20000}
rounds=${2:-3}
wanted=${3:-}
# shellcheck source=scripts/side-by-side.sh
. scripts/side-by-side.sh

# A configuration: lanes (`serve` for serve's default), then the batch size.
configurations=("1 1" "4 1" "16 1" "serve 16" "serve 64")

# service ÷ loop for messages per second and for CPU per message, and the goals missed.
compare() { # compare <service msg/s> <loop msg/s> <service µs/msg> <loop µs/msg>
  awk -v sr="$1" -v lr="$2" -v sc="$3" -v lc="$4" 'BEGIN {
    rate = sr / lr; cpu = sc / lc; missed = ""
    if (rate < 0.9) missed = "msg/s"
    if (cpu > 1.1) missed = missed (missed == "" ? "" : ", ") "CPU"
    printf "%.2f %.2f %s\n", rate, cpu, (missed == "" ? "met" : "missed: " missed)
  }'
}

# Whether configuration k of backend was asked for.
wanted() { # wanted <backend> <k>
  [ -z "$wanted" ] && return 0
  local configuration=${configurations[$2]}
  [[ " $wanted " == *" $1:${configuration/ /x} "* ]]
}

declare -A figures first
for backend in postgres sqlite; do
  for round in $(seq 1 "$rounds"); do
    for k in "${!configurations[@]}"; do
      wanted $backend "$k" || continue
      read -r n batch <<<"${configurations[$k]}"
      [ "$n" = serve ] && n=${lanes[$backend]}
      # Alternates between rounds and between configurations: a run's place in the pair
      # (a machine warmed or disturbed by the run before) falls on both alike.
      if (((round + k) % 2)); then order=(service loop); else order=(loop service); fi
      first[$backend,$k,$round]=${order[0]}
      for consumer in "${order[@]}"; do
        report=$(run "$consumer" $backend "$n" "$batch")
        figures[$backend,$k,$round,$consumer]=$(jq -r '"\(.messages_per_second) \(.cpu_micros_per_message)"' <<<"$report")
        jq -r --arg backend $backend --arg round "$round" --arg consumer "$consumer" \
          '"\($backend) round \($round)  \(.concurrency) lanes, batch \(.batch_size)  \($consumer): \(.messages_per_second | round) msg/s, \(.cpu_micros_per_message * 10 | round / 10) µs CPU/msg (user \(.cpu_user_seconds * 1e6 / .messages | round), system \(.cpu_system_seconds * 1e6 / .messages | round))"' \
          <<<"$report" >&2
      done
    done
  done
done

echo
echo "service ÷ hand-written sqlx loop, $messages orders a run (10% resent under new ids), $books books, $rounds rounds"
echo "goals: msg/s ratio at least 0.9, CPU per message ratio at most 1.1"
printf '%-9s %6s %6s %6s %-8s %10s %10s %6s %11s %11s %6s  %s\n' backend lanes batch round first \
  "svc msg/s" "loop msg/s" ratio "svc µs/msg" "loop µs/msg" ratio goals
for backend in postgres sqlite; do
  for k in "${!configurations[@]}"; do
    wanted $backend "$k" || continue
    read -r n batch <<<"${configurations[$k]}"
    [ "$n" = serve ] && n=${lanes[$backend]}
    for round in $(seq 1 "$rounds"); do
      read -r service_rate service_cpu <<<"${figures[$backend,$k,$round,service]}"
      read -r loop_rate loop_cpu <<<"${figures[$backend,$k,$round,loop]}"
      read -r rate_ratio cpu_ratio goals < <(compare "$service_rate" "$loop_rate" "$service_cpu" "$loop_cpu")
      printf '%-9s %6s %6s %6s %-8s %10.0f %10.0f %6s %11.1f %11.1f %6s  %s\n' $backend "$n" "$batch" \
        "$round" "${first[$backend,$k,$round]}" "$service_rate" "$loop_rate" "$rate_ratio" \
        "$service_cpu" "$loop_cpu" "$cpu_ratio" "$goals"
    done
  done
done
