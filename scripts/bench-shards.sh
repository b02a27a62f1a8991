#!/usr/bin/env bash
# CPU per message of stock sharded by book, for K = 1, 2 and 4 shards side by side in one run,
# at one fixed total load: what a shard costs, not what K shards can do (on one machine the
# shards share its cores, so throughput cannot grow with K here).
#
# For each K: a nats-server of its own (2.10 or later: the subject transform), a PostgreSQL
# database per shard on the local server, `inventory shard init` (P = 64), `shard assign` of an
# equal contiguous range of partitions to each shard, `stock put` of each book on the shard
# `shard of --book-id` names, and one `inventory serve --shard NAME` per shard with its
# defaults. Then, with no load, the idle CPU of the instances, of nats-server and of the
# shards' PostgreSQL processes (the fixed overhead: each instance's fetch requests on its P/K
# partition consumers and its unroutable one, the relay, the watchers). Then `inventory bench
# publish-rate` puts the same rate of orders on their books' subjects, uniform over the same
# books, and the CPU of the steady part (after a warm-up) is read from /proc: the instances,
# PostgreSQL (the postmaster, its auxiliary processes and the shards' backends; other
# databases' backends left out), nats-server; the publisher's own is reported apart. At the
# end of each K: every order reserved exactly once (reservations and the sum of `reserved`
# over the shards equal the orders published) and no dead letter. The batch fill is each
# shard's reservations over the transactions that wrote them (distinct xmin).
#
#   scripts/bench-shards.sh [orders/s, default 2000] [seconds measured, default 30] [shard counts, default "1 2 4"]
#
# Env: BOOKS (default 1000), WARMUP and IDLE seconds (10, 20), DATABASE_URL (a postgres:// URL
# whose user may create databases; default the local server), NATS_SERVER_BIN (default
# target/nats-current/bin/nats-server, as scripts/test.sh installs it), BIN_DIR (the release
# `inventory` and `inventory-study`; built here when unset). Needs psql, curl and jq.
set -eEuo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

rate=${1:-2000}
seconds=${2:-30}
counts=${3:-"1 2 4"}
books=${BOOKS:-1000}
warmup=${WARMUP:-10}
idle=${IDLE:-20}
partitions=64
tag=bench_shards_$$
# shellcheck source=scripts/shard-bench-lib.sh
. scripts/shard-bench-lib.sh
trap cleanup EXIT

# serve, postgres, nats-server and machine ticks now, and the time.
snapshot() { # snapshot <nats pid> <serve pid>…
  local nats=$1
  shift
  echo "$(ticks_of "$@") $(postgres_ticks) $(ticks_of "$nats") $(machine_ticks) $(date +%s.%N)"
}

# Orders reserved so far over the shards' databases.
reserved() { # reserved <database>…
  local database sum=0
  for database in "$@"; do
    # Retried: other sessions on the server can hold every connection for a moment.
    local count=""
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      count=$(psql "$(url_of "$database")" -Atqc 'SELECT count(*) FROM stock_reservations' 2>/dev/null) && break
      sleep 0.5
    done
    sum=$((sum + count))
  done
  echo "$sum"
}

# The books: random UUIDs, lowercase as producers write them.
for _ in $(seq 1 "$books"); do cat /proc/sys/kernel/random/uuid; done >"$work/books"

results=()
for k in $counts; do
  log "K = $k: nats-server, $k databases, shard init, assign, stock put"
  start_nats "$k"
  databases=()
  share=$((partitions / k))
  for i in $(seq 0 $((k - 1))); do
    databases+=("${tag}_k${k}_s$i")
    create_database "${databases[$i]}"
  done
  "$inventory" shard init --partitions $partitions >>"$work/setup.log" 2>&1
  for i in $(seq 0 $((k - 1))); do
    DATABASE_URL=$(url_of "${databases[$i]}") "$inventory" shard assign \
      --partitions "$((i * share))-$(((i + 1) * share - 1))" --to "shard$i" >>"$work/setup.log" 2>&1
  done
  put_books "$work/books"
  put=$(for database in "${databases[@]}"; do
    psql "$(url_of "$database")" -Atqc 'SELECT count(*) FROM stock_items'
  done | paste -sd+ | bc)
  [ "$put" -eq "$books" ] || {
    echo "K = $k: $put books put, not $books" >&2
    exit 1
  }
  start_serves "$k"
  sleep 5

  log "K = $k: idle for $idle s"
  read -r s0 p0 n0 m0 t0 < <(snapshot "$nats" "${serves[@]}")
  sleep "$idle"
  read -r s1 p1 n1 m1 t1 < <(snapshot "$nats" "${serves[@]}")
  idle_figures=$(awk -v s="$((s1 - s0))" -v p="$((p1 - p0))" -v n="$((n1 - n0))" -v m="$((m1 - m0))" \
    -v t="$(echo "$t1 - $t0" | bc -l)" -v hz="$ticks_per_second" -v k="$k" 'BEGIN {
      ms = 1000 / hz / t
      # per instance: serve; nats-server and PostgreSQL whole; the total over K
      printf "%.1f %.1f %.1f %.1f", s * ms / k, n * ms, p * ms, (s + n + p) * ms / k
    }')

  orders=$((rate * (warmup + seconds + 5)))
  log "K = $k: $orders orders at $rate/s over $books books"
  load=$(uptime | sed 's/.*load average: //')
  "$study" bench publish-rate --books-file "$work/books" --rate "$rate" --messages "$orders" \
    >"$work/publish-$k.json" 2>"$work/publish-$k.log" &
  publisher=$!
  pids+=("$publisher")
  sleep "$warmup"
  # The CPU read first, then the orders reserved and the time: both windows as long, the
  # second a snapshot's reading later than the first.
  read -r s0 p0 n0 m0 _ < <(snapshot "$nats" "${serves[@]}")
  r0=$(reserved "${databases[@]}")
  t0=$(date +%s.%N)
  sleep "$seconds"
  read -r s1 p1 n1 m1 _ < <(snapshot "$nats" "${serves[@]}")
  r1=$(reserved "${databases[@]}")
  t1=$(date +%s.%N)
  load_after=$(uptime | sed 's/.*load average: //')
  wait "$publisher" || {
    cat "$work/publish-$k.log" >&2
    exit 1
  }
  published=$(jq .messages "$work/publish-$k.json")
  for _ in $(seq 1 600); do
    [ "$(reserved "${databases[@]}")" -ge "$published" ] && break
    sleep 0.2
  done
  sleep 2

  # Every order reserved exactly once, no dead letter.
  rows=0 sum=0 fill=""
  for database in "${databases[@]}"; do
    read -r r s f < <(psql "$(url_of "$database")" -AtqF' ' -c "
      SELECT (SELECT count(*) FROM stock_reservations),
             (SELECT coalesce(sum(reserved), 0) FROM stock_items),
             (SELECT round(count(*)::numeric / greatest(count(DISTINCT xmin::text), 1), 1)
                FROM stock_reservations)")
    rows=$((rows + r))
    sum=$((sum + s))
    fill+="${fill:+/}$f"
  done
  dead=$(stream_messages DLQ)
  check="ok"
  if [ "$rows" -ne "$published" ] || [ "$sum" -ne "$published" ] || [ "$dead" -ne 0 ]; then
    check="FAILED: $published published, $rows reservations, $sum reserved, $dead dead letters"
  fi
  log "K = $k: $check"

  results+=("$(awk -v k="$k" -v r="$((r1 - r0))" -v s="$((s1 - s0))" -v p="$((p1 - p0))" \
    -v n="$((n1 - n0))" -v m="$((m1 - m0))" -v t="$(echo "$t1 - $t0" | bc -l)" \
    -v hz="$ticks_per_second" -v idle="$idle_figures" -v fill="$fill" -v check="$check" \
    -v pub="$(jq .publisher_cpu_micros_per_message "$work/publish-$k.json")" \
    -v average="$load -> $load_after" 'BEGIN {
      us = 1e6 / hz / r
      split(idle, i, " ")
      printf "| %d | %.0f | %.1f | %.1f | %.1f | **%.1f** | %s | %.1f | %.1f / %.1f | %.1f | %.1f | %.1f | %s | %s |\n",
        k, r / t, s * us, p * us, n * us, (s + p + n) * us, fill, i[1], i[2], i[3], i[4],
        pub, (m - s - p - n) * us, average, check
    }')")
  printf '%s\n' "${results[-1]}" >&2

  stop "${serves[@]}" "$nats"
  drop_databases
  pids=()
done

echo
echo "stock sharded by book, P = $partitions: $rate orders/s for ${seconds} s after ${warmup} s of warm-up, uniform over $books books; µs of CPU per order reserved"
echo
echo "| K | msg/s | service | PostgreSQL | nats-server | total | batch fill per shard | idle: serve per instance, ms/s | idle: nats-server / PostgreSQL, ms/s | idle total ÷ K, ms/s | publisher | rest of the machine | load average (before -> after) | check |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | --- | --- |"
printf '%s\n' "${results[@]}"
