#!/usr/bin/env bash
# How long `inventory shard move` takes to move one partition holding many reservations, end to
# end and step by step, and how long the partition decides nothing anywhere: from the fence's
# commit on the old shard to the activation on the new one.
#
# Each run: a nats-server of its own (2.11 or later, so the move pauses the consumer), two fresh
# databases on the local PostgreSQL, migrated (`inventory migrate`), `inventory shard init`
# (P = 64) and `shard assign` of the one partition to shard a. Then, by SQL on a, the
# partition's rows: BOOKS books of that partition (their ids chosen by the same FNV-1a as
# `partition_of`), RESERVATIONS reservations spread evenly over them (every 1,000th released,
# with its line cancellation), each book's `reserved` the sum of its reserved reservations.
# Then `inventory shard move --partition P --to b`, each line it prints timestamped as it comes:
# a line is printed once its step has committed and its record was written in the bucket, so a
# step's time is from the line before it to its own. The window is from the fence's line to the
# activation's (both late by the same record write). At the end: b's owner row active at epoch
# 2, a's gone, b holding every reservation and line cancellation, each book's `reserved` the
# sum of its reserved reservations.
#
# With LOAD=R, R placements a second go to the partition's books (`inventory bench
# publish-rate`, the study binary) from 5 s before the move until LOAD_SECONDS after its start,
# served by `serve --shard a` on a and `serve --shard b` on b (started again whenever it exits,
# as its supervisor would: it stops when the assignment changes). The move's drain then waits
# for a's relay. Checked too: every placement reserved exactly once, on b, and no dead letter;
# reported: the longest a placement waited from its publication (its order id is a UUIDv7) to
# its reservation.
#
# With OTHER=N, shard a also holds N reservations of other partitions' books (as many books),
# which the move must leave there: a shard holds many partitions.
#
#   scripts/bench-move.sh [reservations, default 100000] [books, default 100] [runs, default 3]
#
# Env: LOAD (placements a second during the move, default 0), LOAD_SECONDS (default 40), OTHER
# (default 0),
# PARTITION (default 7), DATABASE_URL (a postgres:// URL whose user may create databases;
# default the local server), NATS_SERVER_BIN (default target/nats-current/bin/nats-server, as
# scripts/test.sh installs it), BIN_DIR (the `inventory` and `inventory-study` binaries; the
# release ones built here when unset). Needs psql, python3, curl and jq.
set -eEuo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

reservations=${1:-100000}
books=${2:-100}
runs=${3:-3}
load=${LOAD:-0}
load_seconds=${LOAD_SECONDS:-40}
other=${OTHER:-0}
partition=${PARTITION:-7}
partitions=64
tag=bench_move_$$
# shellcheck source=scripts/shard-bench-lib.sh
. scripts/shard-bench-lib.sh
trap 'stop_b_loop; cleanup' EXIT

# BOOKS random book ids of the partition, lowercase as producers write them; with OTHER, as
# many of other partitions.
python3 - "$books" "$partition" "$partitions" "$work/books" "$work/others" <<'EOF'
import sys, uuid
count, partition, partitions = map(int, sys.argv[1:4])
def fnv1a(data):
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h
ours, others = [], []
while len(ours) < count or len(others) < count:
    book = str(uuid.uuid4())
    mine = fnv1a(book.encode()) % partitions == partition
    (ours if mine else others).append(book)
for path, found in zip(sys.argv[4:], (ours, others)):
    with open(path, "w") as out:
        out.write("".join(book + "\n" for book in found[:count]))
EOF

# The partition's rows on shard a's database, by SQL (its books titled "Book <n>"); with OTHER,
# that many reservations of other partitions' books too (titled "Other <n>"), which stay on a.
load_rows() { # load_rows <database url>
  awk '{ print NR - 1 "," $0 }' "$work/books" >"$work/books.csv"
  awk '{ print NR - 1 "," $0 }' "$work/others" >"$work/others.csv"
  psql "$1" -qX -v ON_ERROR_STOP=1 -v reservations="$reservations" -v books="$books" -v other="$other" <<EOF
BEGIN;
CREATE TEMP TABLE bench_books (n int PRIMARY KEY, book_id uuid NOT NULL);
\\copy bench_books FROM '$work/books.csv' WITH (FORMAT csv)
CREATE TEMP TABLE other_books (n int PRIMARY KEY, book_id uuid NOT NULL);
\\copy other_books FROM '$work/others.csv' WITH (FORMAT csv)
INSERT INTO stock_items (book_id, title, on_hand, reserved)
  SELECT book_id, 'Other ' || n, 1000000000, 0 FROM other_books WHERE :other > 0;
INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, created_at)
  SELECT gen_random_uuid(), b.book_id, 1, 'reserved', 'bench-other-' || i, now()
  FROM generate_series(0, :other - 1) AS i JOIN other_books b ON b.n = i % :books;
INSERT INTO stock_items (book_id, title, on_hand, reserved)
  SELECT book_id, 'Book ' || n, 1000000000, 0 FROM bench_books;
INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, created_at)
  SELECT gen_random_uuid(), b.book_id, 1 + i % 3,
         CASE WHEN i % 1000 = 999 THEN 'released' ELSE 'reserved' END,
         'bench-move-' || i, now() - i * interval '1 second'
  FROM generate_series(0, :reservations - 1) AS i JOIN bench_books b ON b.n = i % :books;
INSERT INTO line_cancellations (order_id, book_id, cancelled_at, cancel_message_id)
  SELECT order_id, book_id, now(), 'bench-move-cancel-' || message_id
  FROM stock_reservations WHERE status = 'released';
UPDATE stock_items s SET reserved = r.held
  FROM (SELECT book_id, sum(quantity) AS held FROM stock_reservations
        WHERE status = 'reserved' GROUP BY book_id) r
  WHERE s.book_id = r.book_id;
COMMIT;
ANALYZE;
EOF
}

# One line of figures about a database's rows of the partition's books (titled "Book <n>"):
# books, reservations, line cancellations, reserved units, books whose `reserved` is not their
# reservations' sum.
rows_of() { # rows_of <database url>
  psql "$1" -AtqX -F' ' -c "
    WITH ours AS (SELECT book_id, reserved FROM stock_items WHERE title LIKE 'Book %')
    SELECT (SELECT count(*) FROM ours),
           (SELECT count(*) FROM stock_reservations WHERE book_id IN (SELECT book_id FROM ours)),
           (SELECT count(*) FROM line_cancellations WHERE book_id IN (SELECT book_id FROM ours)),
           (SELECT coalesce(sum(reserved), 0) FROM ours),
           (SELECT count(*) FROM ours s WHERE reserved <> (SELECT coalesce(sum(quantity), 0)
              FROM stock_reservations r WHERE r.book_id = s.book_id AND r.status = 'reserved'))"
}

# `serve --shard b`, started again each time it exits, until $work/stop-b exists.
b_loop=""
start_b_loop() { # start_b_loop <database url> <log>
  rm -f "$work/stop-b"
  (
    while [ ! -e "$work/stop-b" ]; do
      DATABASE_URL=$1 "$inventory" serve --shard b --metrics-addr 127.0.0.1:0 >>"$2" 2>&1 &
      echo $! >"$work/b.pid"
      wait $! || true
      sleep 0.2
    done
  ) &
  b_loop=$!
}
stop_b_loop() {
  [ -n "$b_loop" ] || return 0
  touch "$work/stop-b"
  if [ -s "$work/b.pid" ]; then kill -TERM "$(cat "$work/b.pid")" 2>/dev/null || true; fi
  wait "$b_loop" 2>/dev/null || true
  b_loop=""
}

table=()
for run in $(seq 1 "$runs"); do
  log "run $run: nats-server, two databases, shard init, assign partition $partition to a"
  start_nats "run$run"
  a=${tag}_r${run}_a
  b=${tag}_r${run}_b
  create_database "$a"
  create_database "$b"
  "$inventory" shard init --partitions $partitions >>"$work/setup.log" 2>&1
  DATABASE_URL=$(url_of "$a") "$inventory" shard assign --partitions "$partition" --to a \
    >>"$work/setup.log" 2>&1
  first=$(head -1 "$work/books")
  "$inventory" shard of --book-id "$first" --json | jq -e ".partition == $partition" >/dev/null || {
    echo "book $first is not of partition $partition" >&2
    exit 1
  }
  log "run $run: $reservations reservations over $books books on a"
  load_rows "$(url_of "$a")"
  read -r before_books before_rows before_cancelled before_reserved _ < <(rows_of "$(url_of "$a")")
  psql "$(url_of "$a")" -AtqX -c "SELECT order_id || ' ' || book_id FROM stock_reservations
    WHERE message_id LIKE 'bench-move-%'" | sort >"$work/keys-a"

  published=0
  if [ "$load" != 0 ]; then
    log "run $run: serve --shard a and b, $load placements/s"
    DATABASE_URL=$(url_of "$a") "$inventory" serve --shard a --metrics-addr 127.0.0.1:0 \
      >"$work/serve-a-$run.log" 2>&1 &
    serve_a=$!
    pids+=("$serve_a")
    start_b_loop "$(url_of "$b")" "$work/serve-b-$run.log"
    until grep -qs 'serving a shard' "$work/serve-a-$run.log"; do sleep 0.2; done
    "$study" bench publish-rate --books-file "$work/books" --rate "$load" \
      --messages $((load * (load_seconds + 5))) >"$work/publish-$run.json" 2>"$work/publish-$run.log" &
    publisher=$!
    pids+=("$publisher")
    sleep 5
  fi

  log "run $run: shard move --partition $partition --to b"
  average=$(sed 's/.*load average: //; s/,.*//' <<<"$(uptime)")
  start=$EPOCHREALTIME
  INVENTORY_FROM_DATABASE_URL=$(url_of "$a") INVENTORY_TO_DATABASE_URL=$(url_of "$b") \
    "$inventory" shard move --partition "$partition" --to b 2>"$work/move-$run.err" |
    while IFS= read -r line; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done >"$work/move-$run.out" || {
    cat "$work/move-$run.out" "$work/move-$run.err" >&2
    exit 1
  }
  end=$EPOCHREALTIME
  average+=" -> $(sed 's/.*load average: //; s/,.*//' <<<"$(uptime)")"
  sed "s/^/    /" "$work/move-$run.out" >&2

  if [ "$load" != 0 ]; then
    wait "$publisher" || {
      cat "$work/publish-$run.log" >&2
      exit 1
    }
    published=$(jq .messages "$work/publish-$run.json")
    for _ in $(seq 1 600); do
      read -r _ rows _ < <(rows_of "$(url_of "$b")")
      [ "$rows" -ge $((before_rows + published)) ] && break
      sleep 0.2
    done
    sleep 2
    stop_b_loop
    stop "$serve_a"
  fi

  # What the move left: b holds it all, active at epoch 2; a holds nothing of it.
  read -r after_books after_rows after_cancelled after_reserved unbalanced < <(rows_of "$(url_of "$b")")
  read -r left_books left _ < <(rows_of "$(url_of "$a")")
  others_left=$(psql "$(url_of "$a")" -AtqX -c "SELECT count(*) FROM stock_reservations WHERE message_id LIKE 'bench-other-%'")
  owner_b=$(psql "$(url_of "$b")" -AtqX -c "SELECT shard || ' ' || epoch || ' ' || state FROM partition_owner WHERE partition_id = $partition")
  owner_a=$(psql "$(url_of "$a")" -AtqX -c "SELECT count(*) FROM partition_owner")
  missing=$(psql "$(url_of "$b")" -AtqX -c "SELECT order_id || ' ' || book_id FROM stock_reservations" |
    sort | comm -23 "$work/keys-a" - | wc -l)
  # The longest a placement waited: its order id is a UUIDv7, made when it was published
  # (milliseconds in its first 48 bits), its reservation's created_at when it was decided.
  waited=$(psql "$(url_of "$b")" -AtqX -c "
    SELECT coalesce(round(extract(epoch FROM max(created_at - to_timestamp(
             ('x' || substr(replace(order_id::text, '-', ''), 1, 12))::bit(48)::bigint / 1000.0)))::numeric, 2), 0)
    FROM stock_reservations WHERE message_id NOT LIKE 'bench-move-%'")
  dead=$(stream_messages DLQ)
  check=ok
  if [ "$owner_b" != "b 2 active" ] || [ "$owner_a" != 0 ] || [ "$left" != 0 ] || [ "$left_books" != 0 ] || [ "$others_left" != "$other" ] || [ "$missing" != 0 ] ||
    [ "$after_books" != "$before_books" ] || [ "$after_cancelled" != "$before_cancelled" ] ||
    [ "$after_rows" != $((before_rows + published)) ] ||
    [ "$after_reserved" != $((before_reserved + published)) ] || [ "$unbalanced" != 0 ] || [ "$dead" != 0 ]; then
    check="FAILED: b's owner row '$owner_b', a's owner rows $owner_a, a's reservations $left (other partitions' $others_left of $other), \
missing on b $missing, books $before_books -> $after_books, reservations $before_rows + $published -> $after_rows, \
cancellations $before_cancelled -> $after_cancelled, reserved $before_reserved + $published -> $after_reserved, \
books out of balance $unbalanced, dead letters $dead"
  fi
  log "run $run: $check"

  # The step times: each line's time minus the one before (the first: from the start).
  row=$(awk -v start="$start" -v end="$end" -v run="$run" -v average="$average" -v check="$check" \
    -v published="$published" -v waited="$waited" '
    {
      t = $1; step = $0
      sub(/^[^ ]+ partition [0-9]+: /, "", step); sub(/ → .*/, "", step); sub(/:.*/, "", step)
      if (NR == 1) step = "begin"
      took[step] += t - (NR == 1 ? start : last)
      last = t
      if (step == "pause") paused = t
      if (step == "fence") fenced = t
      if (step == "activate") active = t
      if (step == "resume") resumed = t
    }
    END {
      printf "| %d | %.2f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | **%.3f** | %.3f | %s | %s | %s | %s |\n",
        run, end - start, took["begin"], took["pause"], took["fence"], took["copy"], took["drain"],
        took["hand over"], took["activate"], took["resume"], took["remove"], took["done"],
        active - fenced, resumed - paused, published, (published ? waited : "-"), average, check
    }' "$work/move-$run.out")
  table+=("$row")
  printf '%s\n' "$row" >&2

  stop "$nats"
  drop_databases
  pids=()
done

echo
echo "shard move of partition $partition (P = $partitions): $reservations reservations over $books books, shard a holding $other of other partitions; seconds; load ${load} placements/s"
echo
echo "| run | total | begin | pause | fence | copy | drain | hand over | activate | resume | remove | done | fence -> active | paused -> resumed | placements meanwhile | longest a placement waited | load average, 1 min (before -> after) | check |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"
printf '%s\n' "${table[@]}"
