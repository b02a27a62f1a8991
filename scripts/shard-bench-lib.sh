# shellcheck shell=bash disable=SC2154,SC2034 # the variables named below are shared with the sourcing script
# Sourced by scripts/bench-shards.sh and scripts/bench-shard-ceilings.sh: a nats-server of a
# run's own, its databases on the local PostgreSQL, CPU ticks from /proc. Expects `tag` (the
# prefix of the run's databases); sets `work` (a scratch directory); `pids` collects what to stop.
# What both scripts run on: PostgreSQL (DATABASE_URL), nats-server 2.10+ (NATS_SERVER_BIN) and
# the release binaries (BIN_DIR, else built here).

server=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
nats_server=${NATS_SERVER_BIN:-target/nats-current/bin/nats-server}
unset DATABASE_URL RUST_LOG

bin=${BIN_DIR:-}
if [ -z "$bin" ]; then
  cargo build --release --locked --bins >&2
  bin=${CARGO_TARGET_DIR:-target}/release
fi
inventory=$bin/inventory
study=$bin/inventory-study
ticks_per_second=$(getconf CLK_TCK)

work=$(mktemp -d)
pids=()

log() { printf '==> %s\n' "$*" >&2; }

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Starts a nats-server with JetStream in a directory of its own: sets `nats` (its pid),
# `monitor` (its monitoring port) and exports NATS_URL.
start_nats() { # start_nats <name>
  local port
  port=$(free_port)
  monitor=$(free_port)
  mkdir -p "$work/nats-$1"
  "$nats_server" -a 127.0.0.1 -p "$port" -m "$monitor" -js -sd "$work/nats-$1" >"$work/nats-$1.log" 2>&1 &
  nats=$!
  pids+=("$nats")
  export NATS_URL=nats://127.0.0.1:$port
  until curl -sf "http://127.0.0.1:$monitor/healthz?js-enabled-only=true" >/dev/null; do sleep 0.1; done
}

# Stops the processes named (SIGTERM) and waits for them.
stop() { # stop <pid>…
  local pid
  for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}

# The URL of the run's database `name` on the server.
url_of() { echo "${server%/*}/$1"; }

# A fresh database, migrated.
create_database() { # create_database <name>
  psql "$server" -qc "CREATE DATABASE $1" >/dev/null
  DATABASE_URL=$(url_of "$1") "$inventory" migrate >>"$work/setup.log" 2>&1
}

drop_databases() {
  local database
  for database in $(psql "$server" -Atqc "SELECT datname FROM pg_database WHERE datname LIKE '${tag}_%'"); do
    psql "$server" -qc "DROP DATABASE $database WITH (FORCE)" >/dev/null || true
  done
}

# What to undo on the way out: the processes started, the databases, the scratch directory.
cleanup() {
  stop "${pids[@]}"
  drop_databases
  rm -rf "$work"
}

# utime + stime of the processes named, in ticks (a process gone counts nothing).
ticks_of() { # ticks_of <pid>…
  local pid sum=0 fields
  for pid in "$@"; do
    fields=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null) || continue
    sum=$((sum + $(awk '{ print $12 + $13 }' <<<"$fields")))
  done
  echo "$sum"
}

# The PostgreSQL processes a run pays for: the postmaster, the auxiliary processes, and the live
# backends of the run's databases (serve's pools live through a window). Other databases'
# backends (another session's work on the same server) are left out, and so is the time of the
# postmaster's children that ended, which would count the backends of other sessions' tests.
postgres_ticks() {
  local pid command sum=0 fields
  for pid in $(pgrep -x postgres); do
    command=$({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null) || continue
    if [[ $command == *"("* || $command == *"[local]"* || $command == *" worker "* ]] &&
      [[ $command != *" ${tag}_"* ]]; then
      continue
    fi
    fields=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null) || continue
    sum=$((sum + $(awk '{ print $12 + $13 }' <<<"$fields")))
  done
  echo "$sum"
}

# The machine's busy ticks (all CPUs), from /proc/stat.
machine_ticks() {
  awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat
}

# Puts each book of the file on the shard `inventory shard of` names for it, eight at a time;
# `databases` holds the shards' databases, shard i named `shard<i>`.
put_books() { # put_books <file of book ids>
  local book putting=()
  while read -r book; do
    (
      shard=$("$inventory" shard of --book-id "$book" --json | jq -r .shard)
      DATABASE_URL=$(url_of "${databases[${shard#shard}]}") "$inventory" stock put \
        --book-id "$book" --title "Book $book" --on-hand 100000000 >/dev/null
    ) 2>>"$work/setup.log" &
    putting+=($!)
    if ((${#putting[@]} == 8)); then
      wait "${putting[@]}"
      putting=()
    fi
  done <"$1"
  # A bare `wait` would wait for the nats-server too.
  if ((${#putting[@]})); then wait "${putting[@]}"; fi
}

# Starts `inventory serve --shard shard<i>` on each of `databases`, with its defaults: sets
# `serves` to their pids once each serves.
start_serves() { # start_serves <log name>
  local i
  serves=()
  for i in "${!databases[@]}"; do
    DATABASE_URL=$(url_of "${databases[$i]}") "$inventory" serve --shard "shard$i" \
      --metrics-addr 127.0.0.1:0 >"$work/serve-$1-$i.log" 2>&1 &
    serves+=($!)
    pids+=($!)
  done
  for i in "${!databases[@]}"; do
    until grep -qs 'serving a shard' "$work/serve-$1-$i.log"; do
      kill -0 "${serves[$i]}" 2>/dev/null || {
        tail -20 "$work/serve-$1-$i.log" >&2
        return 1
      }
      sleep 0.2
    done
  done
}

# Messages in the stream named, from the server's monitoring endpoint.
stream_messages() { # stream_messages <stream>
  curl -sf "http://127.0.0.1:$monitor/jsz?streams=true" |
    jq --arg name "$1" '[.account_details[].stream_detail[] | select(.name == $name) | .state.messages] | add // 0'
}
