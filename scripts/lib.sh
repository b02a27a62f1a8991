# Sourced by the scripts that bring up what they need on a Debian machine: progress on stderr,
# root's commands (sudo when not root), Debian's packages, and podman as this sandbox runs it.

log() { printf '==> %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_install() {
  log "installing $* from Debian's packages"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# podman with the settings this sandbox needs (no crun with hybrid cgroups, no raising ulimits),
# kept here rather than in the Containerfile: PODMAN_RUNTIME (runc), PODMAN_CGROUP_MANAGER
# (cgroupfs), CONTAINERS_CONF (a file with `default_ulimits = []`); set one to empty for
# podman's own default. Exported, so that a script this one runs uses the same.
podman_settings() {
  export PODMAN_RUNTIME=${PODMAN_RUNTIME-runc}
  export PODMAN_CGROUP_MANAGER=${PODMAN_CGROUP_MANAGER-cgroupfs}
  if [ -z "${CONTAINERS_CONF+set}" ]; then
    mkdir -p target/image
    printf '[containers]\ndefault_ulimits = []\n' >target/image/containers.conf
    CONTAINERS_CONF=$PWD/target/image/containers.conf
  fi
  export CONTAINERS_CONF
}

pod() {
  as_root env ${CONTAINERS_CONF:+CONTAINERS_CONF="$CONTAINERS_CONF"} podman \
    ${PODMAN_RUNTIME:+--runtime "$PODMAN_RUNTIME"} \
    ${PODMAN_CGROUP_MANAGER:+--cgroup-manager "$PODMAN_CGROUP_MANAGER"} "$@"
}

# HAProxy fronts the primary and the standby in the failover tests; they start their own, so
# the package's service is not used.
ensure_haproxy() {
  command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || apt_install haproxy
}

# Patroni and etcd run a shard's PostgreSQL HA pair (tests/src/patroni.rs: the slow tier's
# Patroni tests, and scripts/patroni-pair.sh); the pair starts its own processes, so the
# packages' services are not used.
ensure_patroni() {
  local missing=()
  command -v patroni >/dev/null || missing+=(patroni)
  command -v etcd >/dev/null || missing+=(etcd-server)
  if [ "${#missing[@]}" -gt 0 ]; then apt_install "${missing[@]}"; fi
}
