#!/usr/bin/env bash
# A shard's PostgreSQL HA pair on this one machine, as docs/deploying.md ("With Patroni")
# describes it: etcd, two Patroni nodes with synchronous replication, HAProxy following the
# leader. Prints the URLs; Ctrl-C stops all of it. Installs Debian's postgresql, patroni,
# etcd-server and haproxy when absent. Try a failover by killing the leader's Patroni and
# PostgreSQL (the printed leader's processes); HAProxy's URL then reaches the other node.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lib.sh

ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || apt_install postgresql
ensure_haproxy
ensure_patroni
exec cargo run --quiet --locked -p inventory-tests --bin patroni-pair
