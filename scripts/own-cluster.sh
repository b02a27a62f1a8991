# Sourced by the benchmark scripts that run a PostgreSQL cluster of their own, so that no other
# database's traffic lands in their figures: Debian's postgresql package, a temporary directory,
# a free port; as root, the server runs as the postgres user.

as_postgres() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

# Makes a cluster in directory $1 (its parent a temporary directory of the caller's) and starts
# it; sets pg_bin and url.
own_cluster_start() {
  local data=$1 port
  pg_bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  [ "$(id -u)" -ne 0 ] || chown postgres "$(dirname "$data")"
  as_postgres "$pg_bin/initdb" -D "$data" -A trust -U postgres -E UTF8 --locale=C --no-sync >/dev/null
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  as_postgres "$pg_bin/pg_ctl" -D "$data" -l "$data.log" -w \
    -o "-p $port -k $(dirname "$data") -c listen_addresses=127.0.0.1" start >/dev/null
  url="postgres://postgres@127.0.0.1:$port/postgres"
}

# Stops the cluster in $1; $2 the shutdown mode, fast unless given.
own_cluster_stop() { as_postgres "$pg_bin/pg_ctl" -D "$1" -m "${2:-fast}" -w stop >/dev/null; }
