#!/usr/bin/env bash
# `inventory serve --strategy natural` as a process, with its default flags and with each batch
# size one can set, on PostgreSQL and on SQLite: whether the default is within 0.9 of the
# fastest. Each run: a fresh database with 100 books, a backlog of orders published first to
# streams of the run's own (every tenth book's orders resent under new ids, as a producer's
# retry), then serve started; messages per second from its start to the last order reserved.
# Also serve's own CPU per message (utime + stime of its process, /proc, from its start to the
# last order reserved, the relay's included). The settings run in interleaved rounds (A B C D,
# B C D A, …), so the machine's drift and the place in a round fall on all alike.
#
# With --logging, the settings are instead what serve logs: its default (an info line per
# message reserved, text), the same as JSON, and RUST_LOG=warn (no line per message), to price
# the line per message on the process.
#
#   scripts/bench-serve-defaults.sh [--logging] [orders per run, default 20000] [rounds, default 3]
#
# Needs the local PostgreSQL (or DATABASE_URL, a postgres:// URL whose user may create
# databases), NATS (or NATS_URL), psql and sqlite3. Builds the release binary, unless
# INVENTORY_BIN names one.
set -eEuo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

settings=("default" "--batch-size 1" "--batch-size 16" "--batch-size 64")
if [ "${1:-}" = --logging ]; then
  # A word NAME=value of a setting goes to serve's environment, the rest are its flags.
  settings=("default" "--log-format json" "RUST_LOG=warn")
  shift
fi
orders=${1:-20000}
rounds=${2:-3}
books=100
server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export NATS_URL=${NATS_URL:-nats://127.0.0.1:4222}
# serve's default log filter, unless a setting names one.
unset RUST_LOG

inventory=${INVENTORY_BIN:-}
if [ -z "$inventory" ]; then
  cargo build --release --locked -p inventory-service >&2
  inventory=${CARGO_TARGET_DIR:-target}/release/inventory
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# What the setup commands said, shown when one fails.
trap 'tail -20 "$work/setup.log" >&2' ERR

# Sets DATABASE_URL, the streams' names and `count` (SQL that counts the orders reserved) for
# a run of its own.
fresh() { # fresh <backend> <tag>
  local backend=$1 tag=$2
  case $backend in
    postgres)
      psql "$server" -qc "CREATE DATABASE $tag" >/dev/null
      export DATABASE_URL=${server%/*}/$tag
      count() { psql "$DATABASE_URL" -Atqc 'SELECT count(DISTINCT order_id) FROM stock_reservations'; }
      ;;
    sqlite)
      export DATABASE_URL="sqlite://$work/$tag.db?mode=rwc"
      count() { sqlite3 "$work/$tag.db" 'SELECT count(DISTINCT order_id) FROM stock_reservations'; }
      ;;
  esac
  local upper=${tag^^}
  export INVENTORY_STREAM=ORDERS_$upper INVENTORY_SUBJECT_PREFIX=orders_$tag
  export INVENTORY_DLQ_STREAM=DLQ_$upper INVENTORY_DLQ_SUBJECT_PREFIX=dlq_$tag
  export INVENTORY_EVENTS_STREAM=EVENTS_$upper INVENTORY_EVENTS_SUBJECT_PREFIX=events_$tag
}

drop() { # drop <backend> <tag>
  if [ "$1" = postgres ]; then
    psql "$server" -qc "DROP DATABASE $2 WITH (FORCE)" >/dev/null
  fi
}

# One run: prints messages per second and serve's CPU µs per message.
run() { # run <backend> <tag> [NAME=value …] [serve flags]
  local backend=$1 tag=$2
  shift 2
  local environment=() flags=()
  for word in "$@"; do
    if [[ $word == *=* ]]; then environment+=("$word"); else flags+=("$word"); fi
  done
  fresh "$backend" "$tag"
  "$inventory" migrate >/dev/null 2>>"$work/setup.log"
  local per_book=$((orders / books)) messages=0
  for i in $(seq 1 $books); do
    local book
    book=$(cat /proc/sys/kernel/random/uuid)
    "$inventory" stock put --book-id "$book" --title "Book $i" --on-hand 100000000 >/dev/null 2>>"$work/setup.log"
    if [ $((i % 10)) -eq 0 ]; then
      "$inventory" publish placed --book-id "$book" --quantity 1 --count $per_book \
        --resend-with-new-id >/dev/null 2>>"$work/setup.log"
      messages=$((messages + 2 * per_book))
    else
      "$inventory" publish placed --book-id "$book" --quantity 1 --count $per_book >/dev/null 2>>"$work/setup.log"
      messages=$((messages + per_book))
    fi
  done
  local expected=$((per_book * books)) started ended
  started=$(date +%s.%N)
  env "${environment[@]}" "$inventory" serve --strategy natural --metrics-addr 127.0.0.1:0 \
    "${flags[@]}" >"$work/$tag.log" 2>&1 &
  local service=$!
  until [ "$(count 2>/dev/null || echo 0)" -ge "$expected" ]; do
    if ! kill -0 $service 2>/dev/null; then
      echo "serve $* ended early:" >&2
      tail -20 "$work/$tag.log" >&2
      exit 1
    fi
    sleep 0.05
  done
  ended=$(date +%s.%N)
  # utime and stime, in clock ticks: the 14th and 15th fields, counted after the command's
  # name, which ends at the last ')'.
  local ticks
  ticks=$(sed 's/.*) //' /proc/$service/stat | awk '{ print $12 + $13 }')
  kill -TERM $service
  wait $service || true
  drop "$backend" "$tag"
  echo "$(echo "$messages / ($ended - $started)" | bc -l)" \
    "$(echo "$ticks * 1000000 / $(getconf CLK_TCK) / $messages" | bc -l)"
}

declare -A rates cpus
for backend in postgres sqlite; do
  for round in $(seq 1 "$rounds"); do
    # Each round starts with another setting: the first run of a round came out slower.
    for k in "${!settings[@]}"; do
      i=$(((k + round - 1) % ${#settings[@]}))
      flags=${settings[$i]}
      [ "$flags" = default ] && flags=""
      # shellcheck disable=SC2086 # the flags are words
      result=$(run $backend "bench_serve_$$_${round}_$i" $flags)
      read -r rate cpu <<<"$result"
      rates[$backend,$i]+="$(printf '%.0f' "$rate") "
      cpus[$backend,$i]+="$(printf '%.1f' "$cpu") "
      printf '%-9s round %d  %-18s %8.0f msg/s %8.1f µs CPU/msg\n' $backend "$round" "${settings[$i]}" "$rate" "$cpu" >&2
    done
  done
done

# The round's figures of setting i, relative to setting j: rate[i] / rate[j] or cpu[i] / cpu[j].
ratios() { # ratios <rates|cpus> <backend> <i> <j>
  local -n figures=$1
  local out="" round
  for round in $(seq 1 "$rounds"); do
    out+="$(echo "$(cut -d' ' -f"$round" <<<"${figures[$2,$3]}") / $(cut -d' ' -f"$round" <<<"${figures[$2,$4]}")" |
      bc -l | xargs printf '%.2f') "
  done
  echo "$out"
}

echo
echo "serve --strategy natural as a process, $orders orders (every tenth book's resent under new ids), $books books, $rounds rounds"
printf '%-9s %-18s %-24s %s\n' "backend" "setting" "msg/s per round" "µs CPU/msg per round"
for backend in postgres sqlite; do
  for i in "${!settings[@]}"; do
    printf '%-9s %-18s %-24s %s\n' $backend "${settings[$i]}" "${rates[$backend,$i]}" "${cpus[$backend,$i]}"
  done
  if [ "${settings[1]}" = "--batch-size 1" ]; then
    # The default against the best setting of the same round.
    best=""
    for round in $(seq 1 "$rounds"); do
      top=$(cut -d' ' -f"$round" <<<"${rates[$backend,0]}")
      for i in 1 2 3; do
        rate=$(cut -d' ' -f"$round" <<<"${rates[$backend,$i]}")
        [ "$rate" -gt "$top" ] && top=$rate
      done
      best+="$top "
    done
    rates[$backend,best]=$best
    printf '%-9s %-18s %s\n' $backend "default ÷ best" "$(ratios rates $backend 0 best)"
  else
    # What each setting costs over RUST_LOG=warn, which writes no line per message.
    last=$((${#settings[@]} - 1))
    for i in $(seq 0 $((last - 1))); do
      printf '%-9s %-25s msg/s %s  CPU %s\n' $backend "${settings[$i]} ÷ warn" \
        "$(ratios rates $backend $i $last)" "$(ratios cpus $backend $i $last)"
    done
  fi
done
