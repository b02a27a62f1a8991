#!/usr/bin/env bash
# What each placement statement costs PostgreSQL in CPU, counted rather than timed: the
# instructions a backend executes per statement, under valgrind's callgrind, which counts the
# same for the same input whatever else the machine does (pgbench's rates here vary by 15% from
# round to round). The statements are scripts/bench-cancel-guard.sh's (benches/src/guard_cost.rs):
# minimal, availability, availability-event and reserve (RESERVE_SQL).
#
# Each runs prepared in a single-user backend (`postgres --single`) on a copy of one seeded
# cluster, each execution its own transaction, a fresh order on a random book of 1,000 (arrays
# of one, as a lane binds one message); a run of N1 and one of N2 executions give
# (instructions(N2) - instructions(N1)) / (N2 - N1) per statement, start-up and planning
# cancelled out. User space only: the kernel's side of a
# commit (the WAL write and its flush) is not in the count.
#
#   scripts/bench-statement-instructions.sh [N1, default 500] [N2, default 2500]
#
# Then each part, priced the same way with the part left out of its statement (an edit of the
# statement, or an index dropped first in the same backend).
#
# Needs python3 and Debian's postgresql and valgrind packages (installed when absent, as root);
# about a minute per statement and per part, eight minutes in all once built.
set -euo pipefail
# A failure inside $(...) (a failed run, an edit that matched nothing) ends the script too.
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

n1=${1:-500}
n2=${2:-2500}
books=1000
statements=(minimal availability availability-event reserve)

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
command -v valgrind >/dev/null || as_root apt-get install -y -qq valgrind >/dev/null
ls -d /usr/lib/postgresql/*/bin >/dev/null 2>&1 || as_root apt-get install -y -qq postgresql >/dev/null
source scripts/own-cluster.sh

cargo build --release --locked -p inventory-service -p inventory-benches >&2
inventory=$(realpath "${CARGO_TARGET_DIR:-target}")/release/inventory

dir=$(mktemp -d)
chmod 755 "$dir"
pg_bin=
trap '[ -z "$pg_bin" ] || own_cluster_stop "$dir/seeded" immediate 2>/dev/null || true; rm -rf "$dir"' EXIT
own_cluster_start "$dir/seeded"
DATABASE_URL=$url "$inventory" migrate >/dev/null
psql -q "$url" -c "$("$inventory" bench pgbench-script --seed --books $books)" >/dev/null
own_cluster_stop "$dir/seeded"

# The instructions a single-user backend executes for `$2` executions of statement `$1`, on a
# fresh copy of the seeded cluster. The statement is prepared as the lanes prepare it, and each
# execution binds literal values, as the lanes bind theirs: a fresh order on one of the seeded
# books, drawn with a fixed seed so every statement gets the same orders. (pgbench's form of the
# statement computes its uuids in the statement, md5 by md5, which the lanes never do.) `$3`: a
# perl substitution applied to the statement first (a part left out); `$4`: SQL run once before
# it (a schema change), counted alike in both runs and so cancelled.
instructions() {
  local statement=$1 executions=$2 edit=${3:-} setup=${4:-}
  local sql
  sql=$("$inventory" bench pgbench-script --statement "$statement" --prepared)
  if [ -n "$edit" ]; then
    local edited
    edited=$(perl -pe "$edit" <<<"$sql")
    if [ "$edited" = "$sql" ]; then echo "the edit '$edit' changed nothing in $statement" >&2; exit 1; fi
    sql=$edited
  fi
  {
    [ -z "$setup" ] || echo "$setup"
    echo "PREPARE p(uuid[], uuid[], int4[], text[], int4[], uuid[], int2[]) AS $sql"
    python3 - "$executions" $books <<'PYTHON'
import hashlib, random, sys
executions, books = int(sys.argv[1]), int(sys.argv[2])
uuid = lambda text: hashlib.md5(text.encode()).hexdigest()  # md5('b' || g)::uuid, as seeded
one = lambda value: "'{" + str(value) + "}'"  # an array of one, as a lane binds one message
draw = random.Random(7)
for _ in range(executions):
    n, b = draw.randrange(1, 10**12), draw.randrange(1, books + 1)
    print(f"EXECUTE p({one(uuid(f'o{n}'))}, {one(uuid(f'b{b}'))}, {one(1 + n % 3)}, "
          f"{one(f'pgbench-{n}')}, {one(0)}, {one(uuid(f'e{n}'))}, {one(n % 16)})")
PYTHON
  } >"$dir/input.sql"
  rm -rf "$dir/run"
  cp -a "$dir/seeded" "$dir/run"
  chmod 644 "$dir/input.sql"
  as_postgres valgrind --tool=callgrind --callgrind-out-file="$dir/callgrind.out" \
    "$pg_bin/postgres" --single -D "$dir/run" postgres <"$dir/input.sql" >"$dir/output" 2>"$dir/valgrind"
  if grep -q ERROR "$dir/output"; then
    echo "$statement failed:" >&2; grep -m 3 ERROR "$dir/output" >&2; exit 1
  fi
  sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$dir/valgrind"
}

# Instructions per execution of `instructions`' arguments.
per_statement() {
  local a b
  a=$(instructions "$1" "$n1" "${2:-}" "${3:-}")
  b=$(instructions "$1" "$n2" "${2:-}" "${3:-}")
  echo $(( (b - a) / (n2 - n1) ))
}

printf '%-20s %22s %14s\n' "statement" "instructions/statement" "÷ availability"
declare -A per
for statement in "${statements[@]}"; do
  per[$statement]=$(per_statement "$statement")
done
for statement in "${statements[@]}"; do
  printf '%-20s %22d %14.2f\n' "$statement" "${per[$statement]}" \
    "$(echo "${per[$statement]} / ${per[availability]}" | bc -l)"
done

# The parts: each statement again with one part left out; the difference is the part's cost.
echo
printf '%-58s %12s\n' "part" "instructions"
part() {
  local name=$1 statement=$2 edit=$3 setup=${4:-} without
  without=$(per_statement "$statement" "$edit" "$setup")
  printf '%-58s %12d\n' "$name" $(( per[$statement] - without ))
}
part "reserve: lock_order (false in its place)" reserve \
  's/lock_order\(order_id\)/false/'
part "reserve: the reservation looked up first (made empty)" reserve \
  's/LEFT JOIN LATERAL \(.*?\) existing ON true/LEFT JOIN (SELECT NULL::int4 AS quantity) existing ON true/'
part "availability-event: the event's body (replaced by '')" availability-event \
  "s/jsonb_strip_nulls\\(jsonb_build_object\\(.*?END\\s*\\)\\)::text/''/"
part "availability-event: the unique index on event_id" availability-event \
  "" "ALTER TABLE outbox DROP CONSTRAINT outbox_event_id_key"
part "availability-event: the index on (relay_partition, seq)" availability-event \
  "" "DROP INDEX idx_outbox_partition_seq"
part "availability-event: the partial index of parked rows" availability-event \
  "" "DROP INDEX idx_outbox_parked_order"
