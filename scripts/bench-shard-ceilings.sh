#!/usr/bin/env bash
# The two ceilings sharding by book does not lift (docs/scaling.md, "Sizing"), each measured
# side by side in interleaved rounds, every run on a nats-server (2.10 or later) of its own:
#
# - stream: how many orders a second one stream stores. `inventory bench publish-rate` puts
#   OrderPlaced on their books' subjects (uniform over 1,000 books, a Nats-Msg-Id each, the
#   stream's duplicate window on) as fast as the PubAcks come back, 256 in flight, into the
#   orders stream (file storage, one replica) as it stands: `plain`, with no subject transform;
#   `transform`, with `shard init`'s transform onto 64 partitions and nothing else; `sharded`,
#   after `inventory shard init` (the transform, 64 partition consumers, the unroutable one,
#   the bucket). Prints msg/s and nats-server's CPU µs per message (/proc, from the publisher's
#   start to its end), the publisher's beside it: both share the machine's two cores.
# - hot-row: how many orders a second one book's stock row takes through `inventory serve
#   --shard`, against the same orders spread over 1,000 books. A backlog of orders is published
#   first, then serve started with its defaults on one shard; the rate is from the first
#   reservation's commit to the last's (their created_at), so serve's start is not in it. The
#   batch fill is the reservations over the transactions that wrote them (distinct xmin).
#   `hot`: every order for one book, the shard owning all 64 partitions (so the book's
#   partition has one lane of serve's 10); `hot-alone`: the shard owning only that book's
#   partition (all 10 lanes on it); `spread`: 1,000 books, all 64 partitions.
#
#   scripts/bench-shard-ceilings.sh [stream|hot-row|both, default both] [orders a run, default 200000 / 20000] [rounds, default 3 / 2]
#
# Env as scripts/bench-shards.sh: DATABASE_URL, NATS_SERVER_BIN, BIN_DIR. Needs psql, curl, jq.
set -eEuo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

what=${1:-both}
partitions=64
tag=bench_ceilings_$$
# shellcheck source=scripts/shard-bench-lib.sh
. scripts/shard-bench-lib.sh
trap cleanup EXIT

for _ in $(seq 1 1000); do cat /proc/sys/kernel/random/uuid; done >"$work/books"

# The configurations of a mode in round r's order: each round starts one further along.
in_order() { # in_order <round> <configuration>…
  local round=$1
  shift
  local all=("$@") i
  for i in "${!all[@]}"; do echo "${all[$(((i + round - 1) % ${#all[@]}))]}"; done
}

# Each run sets `result`: msg/s, nats-server's and the publisher's µs per message.
stream_run() { # stream_run <configuration> <orders>
  local configuration=$1 orders=$2 before after report
  start_nats "stream-$configuration"
  case $configuration in
    plain) "$study" bench publish-rate --ensure-streams --books-file "$work/books" --messages 1 >/dev/null ;;
    transform)
      "$study" bench publish-rate --ensure-streams --set-transform $partitions \
        --books-file "$work/books" --messages 1 >/dev/null
      ;;
    sharded)
      "$inventory" shard init --partitions $partitions >>"$work/setup.log" 2>&1
      "$study" bench publish-rate --books-file "$work/books" --messages 1 >/dev/null
      ;;
  esac
  before=$(ticks_of "$nats")
  report=$("$study" bench publish-rate --books-file "$work/books" --messages "$orders")
  after=$(ticks_of "$nats")
  local stored
  stored=$(stream_messages ORDERS)
  [ "$stored" -eq $((orders + 1)) ] || {
    echo "$configuration: $stored stored, not $((orders + 1))" >&2
    exit 1
  }
  stop "$nats"
  pids=()
  rm -rf "$work/nats-stream-$configuration"
  result=$(jq -r --arg nats "$((after - before))" --arg hz "$ticks_per_second" \
    '"\(.messages_per_second) \(($nats | tonumber) * 1e6 / ($hz | tonumber) / .messages) \(.publisher_cpu_micros_per_message)"' \
    <<<"$report")
}

# Each run sets `result`: msg/s and the batch fill.
hot_run() { # hot_run <configuration> <orders>
  local configuration=$1 orders=$2 hot
  hot=$(head -1 "$work/books")
  start_nats "hot-$configuration"
  databases=("${tag}_${configuration//-/_}")
  create_database "${databases[0]}"
  "$inventory" shard init --partitions $partitions >>"$work/setup.log" 2>&1
  local range=0-$((partitions - 1))
  if [ "$configuration" = hot-alone ]; then
    range=$("$inventory" shard of --book-id "$hot" --json | jq .partition)
  fi
  DATABASE_URL=$(url_of "${databases[0]}") "$inventory" shard assign --partitions "$range" \
    --to shard0 >>"$work/setup.log" 2>&1
  if [ "$configuration" = spread ]; then
    put_books "$work/books"
    "$study" bench publish-rate --books-file "$work/books" --messages "$orders" >/dev/null
  else
    head -1 "$work/books" >"$work/hot-book"
    put_books "$work/hot-book"
    "$study" bench publish-rate --book-id "$hot" --messages "$orders" >/dev/null
  fi
  start_serves "$configuration"
  local url reserved=0
  url=$(url_of "${databases[0]}")
  for _ in $(seq 1 1200); do
    reserved=$(psql "$url" -Atqc 'SELECT count(*) FROM stock_reservations')
    [ "$reserved" -ge "$orders" ] && break
    sleep 0.5
  done
  local figures
  figures=$(psql "$url" -AtqF' ' -c "
    SELECT round((count(*) - 1) / extract(epoch FROM max(created_at) - min(created_at)))::bigint,
           round(count(*)::numeric / count(DISTINCT xmin::text), 1),
           (SELECT sum(reserved) FROM stock_items)
    FROM stock_reservations")
  local dead
  dead=$(stream_messages DLQ)
  read -r rate fill sum <<<"$figures"
  if [ "$reserved" -ne "$orders" ] || [ "$sum" -ne "$orders" ] || [ "$dead" -ne 0 ]; then
    echo "$configuration: $orders published, $reserved reservations, $sum reserved, $dead dead letters" >&2
    exit 1
  fi
  stop "${serves[@]}" "$nats"
  pids=()
  drop_databases
  rm -rf "$work/nats-hot-$configuration"
  result="$rate $fill"
}

if [ "$what" = stream ] || [ "$what" = both ]; then
  orders=${2:-200000}
  rounds=${3:-3}
  declare -A stream
  for round in $(seq 1 "$rounds"); do
    for configuration in $(in_order "$round" plain transform sharded); do
      load=$(uptime | sed 's/.*load average: //')
      stream_run "$configuration" "$orders"
      stream[$configuration,$round]=$result
      read -r rate cpu publisher <<<"${stream[$configuration,$round]}"
      printf 'stream round %d  %-9s %8.0f msg/s  nats-server %5.1f µs/msg  publisher %5.1f µs/msg  load %s\n' \
        "$round" "$configuration" "$rate" "$cpu" "$publisher" "$load" >&2
    done
  done
  echo
  echo "one stream (file, R1, duplicate window on), $orders OrderPlaced a run over 1,000 books, 256 PubAcks in flight; per round"
  echo
  echo "| stream | msg/s | nats-server µs/msg | publisher µs/msg |"
  echo "| --- | --- | --- | --- |"
  for configuration in plain transform sharded; do
    rates="" cpus="" publishers=""
    for round in $(seq 1 "$rounds"); do
      read -r rate cpu publisher <<<"${stream[$configuration,$round]}"
      rates+="${rates:+ / }$(printf '%.0f' "$rate")"
      cpus+="${cpus:+ / }$(printf '%.1f' "$cpu")"
      publishers+="${publishers:+ / }$(printf '%.1f' "$publisher")"
    done
    echo "| $configuration | $rates | $cpus | $publishers |"
  done
fi

if [ "$what" = hot-row ] || [ "$what" = both ]; then
  orders=${2:-20000}
  rounds=${3:-2}
  declare -A hot
  for round in $(seq 1 "$rounds"); do
    for configuration in $(in_order "$round" hot hot-alone spread); do
      load=$(uptime | sed 's/.*load average: //')
      hot_run "$configuration" "$orders"
      hot[$configuration,$round]=$result
      read -r rate fill <<<"${hot[$configuration,$round]}"
      printf 'hot-row round %d  %-9s %8s msg/s  batch fill %s  load %s\n' "$round" "$configuration" "$rate" "$fill" "$load" >&2
    done
  done
  echo
  echo "serve --shard, defaults, a backlog of $orders orders; msg/s from the first reservation's commit to the last; per round"
  echo
  echo "| orders for | partitions of the shard | msg/s | batch fill |"
  echo "| --- | --- | --- | --- |"
  for configuration in hot hot-alone spread; do
    rates="" fills=""
    for round in $(seq 1 "$rounds"); do
      read -r rate fill <<<"${hot[$configuration,$round]}"
      rates+="${rates:+ / }$rate"
      fills+="${fills:+ / }$fill"
    done
    case $configuration in
      hot) echo "| one book | all $partitions | $rates | $fills |" ;;
      hot-alone) echo "| one book | its own only | $rates | $fills |" ;;
      spread) echo "| 1,000 books | all $partitions | $rates | $fills |" ;;
    esac
  done
fi
