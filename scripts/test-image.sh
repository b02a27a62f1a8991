#!/usr/bin/env bash
# Builds the image (scripts/image.sh) and tests it: the version names the commit, the user is not
# root, `serve` refuses to start without DATABASE_URL, the study binary is found, and one order
# goes through `serve` in the container against the local PostgreSQL and NATS, which then drains
# on SIGTERM and exits 0. The servers are scripts/test.sh's (PostgreSQL on 127.0.0.1:5432, NATS on
# 127.0.0.1:4222; DATABASE_URL and NATS_URL name others). The test's database and its streams
# have names of their own, dropped at the end. One PASS or FAIL line a check; exit 1 on any FAIL.
# PODMAN_RUNTIME, PODMAN_CGROUP_MANAGER and CONTAINERS_CONF as in scripts/lib.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lib.sh
podman_settings

failures=0
pass() { printf 'PASS: %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*"; failures=$((failures + 1)); }

# The host's binary of the same profile publishes the order.
case ${INVENTORY_IMAGE_PROFILE:-release} in
  dev) binaries=target/debug ;;
  *) binaries=target/${INVENTORY_IMAGE_PROFILE:-release} ;;
esac

start=$SECONDS
image=$(scripts/image.sh | tail -n 1)
log "image $image, built in $((SECONDS - start))s"
tests_start=$SECONDS

# --- (a) the version names the commit --------------------------------------------------------
version=$(pod run --rm "$image" --version 2>&1) || true
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
if [[ $version =~ ^inventory\ [0-9][^\ ]*\ \(commit\ ([0-9a-f]{7,}|unknown), ]] &&
  [ "${BASH_REMATCH[1]}" = "$commit" ]; then
  pass "--version: $version"
else
  fail "--version: '$version' (expected the version and commit $commit)"
fi

# --- (b) not root ----------------------------------------------------------------------------
uid=$(pod run --rm --entrypoint id "$image" -u 2>&1) || true
config_user=$(pod image inspect --format '{{.Config.User}}' "$image")
if [[ $uid =~ ^[0-9]+$ ]] && [ "$uid" -ne 0 ] && [[ $config_user =~ ^[1-9][0-9]*(:[0-9]+)?$ ]]; then
  pass "runs as uid $uid (image user $config_user)"
else
  fail "user: id -u said '$uid', image user '$config_user' (expected a numeric non-root user)"
fi

# --- (c) serve needs an explicit DATABASE_URL --------------------------------------------------
# No network: were the setting ignored, serve could reach no NATS (and so no one's streams) and
# would fail for another reason, which the message tells apart.
env_line=$(pod image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$image" |
  grep '^INVENTORY_REQUIRE_DATABASE_URL=' || true)
set +e
refusal=$(pod run --rm --network=none "$image" serve --strategy natural --metrics-addr off \
  --stream IMAGETEST_NONE --subject-prefix imagetestnone 2>&1)
status=$?
set -e
if [ "$env_line" = INVENTORY_REQUIRE_DATABASE_URL=true ] && [ "$status" -ne 0 ] &&
  grep -qiE 'DATABASE_URL|database-url' <<<"$refusal"; then
  pass "serve without DATABASE_URL refused (exit $status): $(head -n 1 <<<"$refusal")"
else
  fail "serve without DATABASE_URL: exit $status, env '$env_line', output: $(tail -n 3 <<<"$refusal")"
fi

# --- (d) the study binary is found -------------------------------------------------------------
demo_start=$SECONDS
set +e
demo=$(pod run --rm "$image" demo 2>&1)
status=$?
set -e
if [ "$status" -eq 0 ]; then
  pass "demo in the image ($((SECONDS - demo_start))s, $(grep -c . <<<"$demo") lines)"
else
  fail "demo in the image: exit $status: $(tail -n 5 <<<"$demo")"
fi

# --- (e) one order through serve, against PostgreSQL and NATS ------------------------------------
run=$(date +%s)$$
db=inventory_image_$run
name=inventory-image-$run
stream=IMAGETEST_$run
topology=(--stream "$stream" --subject-prefix "imagetest$run" --dlq-stream "${stream}_DLQ"
  --dlq-subject-prefix "imagetestdlq$run" --events-stream "${stream}_EV"
  --events-subject-prefix "imagetestev$run")
nats_url=${NATS_URL:-nats://127.0.0.1:4222}
admin_url=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
if ! psql "$admin_url" -Atqc 'select 1' >/dev/null 2>&1; then
  # scripts/test.sh gives the postgres user this password on a fresh Debian cluster.
  admin_url=postgres://postgres:postgres@127.0.0.1:5432/postgres
fi
db_url=${admin_url%/*}/$db

# Deletes JetStream streams over NATS's text protocol (no `nats` CLI on a Debian machine): one
# $JS.API.STREAM.DELETE request a stream; "stream not found" counts as deleted.
delete_streams() {
  local address=${nats_url#*://} line replies=0 ok=0
  address=${address##*@}
  address=${address%%,*}
  exec 3<>"/dev/tcp/${address%:*}/${address##*:}" || return 1
  {
    printf 'CONNECT {"verbose":false,"pedantic":false,"headers":false}\r\nSUB _INBOX.imagetest.> 1\r\n'
    for s in "$@"; do printf 'PUB $JS.API.STREAM.DELETE.%s _INBOX.imagetest.%s 0\r\n\r\n' "$s" "$s"; done
    printf 'PING\r\n'
  } >&3
  while [ "$replies" -lt "$#" ] && IFS= read -r -t 10 line <&3; do
    case $line in
      '{'*) replies=$((replies + 1))
        if [[ $line == *'"success":true'* || $line == *'"err_code":10059'* ]]; then ok=$((ok + 1)); fi ;;
      -ERR*) log "NATS: $line"; break ;;
    esac
  done
  exec 3<&-
  [ "$ok" -eq "$#" ]
}

cleanup() {
  pod rm -f -t 0 "$name" >/dev/null 2>&1 || true
  psql "$admin_url" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1 ||
    log "could not drop database $db"
  delete_streams "$stream" "${stream}_DLQ" "${stream}_EV" ||
    log "could not delete streams $stream, ${stream}_DLQ, ${stream}_EV"
}
trap cleanup EXIT

http_code() { curl -s -o /dev/null -m 2 -w '%{http_code}' "$1" || true; }

free_port() {
  local port
  while :; do
    port=$((20000 + RANDOM % 40000))
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || { echo "$port"; return; }
  done
}

reserved_of() { # the book's reserved copies in `stock list --json`
  pod run --rm --network=host -e DATABASE_URL="$db_url" "$image" stock list --json 2>/dev/null |
    tr -d ' \n' | grep -o "{[^}]*\"$book\"[^}]*}" | grep -o '"reserved":[0-9]*' | cut -d: -f2
}

in_container() { pod run --rm --network=host -e DATABASE_URL="$db_url" -e NATS_URL="$nats_url" "$image" "$@"; }

order_through_serve() {
  psql "$admin_url" -qc "CREATE DATABASE $db" >/dev/null || { fail "create database $db"; return; }
  in_container migrate >&2 || { fail "migrate"; return; }
  pass "migrate"
  book=$(cat /proc/sys/kernel/random/uuid)
  in_container stock put --book-id "$book" --title T --on-hand 5 >&2 || { fail "stock put"; return; }
  pass "stock put (5 on hand)"

  local port code deadline reserved= status
  port=$(free_port)
  pod run -d --name "$name" --network=host -e DATABASE_URL="$db_url" -e NATS_URL="$nats_url" \
    "$image" serve --strategy natural "${topology[@]}" --metrics-addr "127.0.0.1:$port" >/dev/null ||
    { fail "serve did not start"; return; }
  deadline=$((SECONDS + 60))
  until [ "$(http_code "http://127.0.0.1:$port/readyz")" = 200 ]; do
    if [ "$(pod inspect --format '{{.State.Running}}' "$name")" != true ] || [ "$SECONDS" -ge "$deadline" ]; then
      fail "/readyz never answered 200: $(curl -s -m 2 "http://127.0.0.1:$port/readyz" || true)"
      pod logs "$name" 2>&1 | tail -n 20 >&2
      return
    fi
    sleep 0.5
  done
  pass "serve in the container: /readyz 200"

  NATS_URL=$nats_url "$binaries/inventory" publish "${topology[@]}" placed --book-id "$book" \
    --quantity 2 >&2 || { fail "publish OrderPlaced"; return; }
  deadline=$((SECONDS + 60))
  until reserved=$(reserved_of) && [ "$reserved" = 2 ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      fail "reserved is '$reserved' after 60s, expected 2"
      pod logs "$name" 2>&1 | tail -n 20 >&2
      return
    fi
    sleep 1
  done
  pass "OrderPlaced for 2 copies: reserved 2"

  code=$(http_code "http://127.0.0.1:$port/livez")
  if [ "$code" = 200 ]; then pass "/livez 200"; else fail "/livez answered $code"; fi

  pod stop --time 30 "$name" >/dev/null
  status=$(pod inspect --format '{{.State.ExitCode}}' "$name")
  if [ "$status" = 0 ]; then
    pass "SIGTERM: drained and exited 0"
  else
    fail "SIGTERM: exited $status"
    pod logs "$name" 2>&1 | tail -n 20 >&2
  fi
}
order_through_serve

log "tests of the image: $((SECONDS - tests_start))s"
if [ "$failures" -eq 0 ]; then
  echo "PASS: image $image"
else
  echo "FAIL: image $image: $failures check(s) failed"
  exit 1
fi
