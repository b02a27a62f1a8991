#!/usr/bin/env bash
# Builds the service's container image from this checkout on a Debian machine, with only Debian's
# packages: podman, runc and debootstrap (installed if absent), a debian:bookworm-slim base made
# with debootstrap when podman's storage has none (made once, then cached there), the binaries
# built by cargo on the host (release), then deploy/Containerfile. Progress goes to stderr; the
# last line of stdout is the image reference.
#
# Overrides: INVENTORY_IMAGE (localhost/inventory), DEBIAN_MIRROR, INVENTORY_IMAGE_PROFILE (the
# cargo profile, `release`; CI's `dev` reuses the binaries its tests built, saves the release
# build of every dependency, and tags the image `…-dev` so it is not taken for a release one).
# PODMAN_RUNTIME, PODMAN_CGROUP_MANAGER and CONTAINERS_CONF as scripts/lib.sh says: this
# sandbox's podman settings, kept out of the Containerfile.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/lib.sh

timed() {
  local what=$1 start=$SECONDS; shift
  "$@"
  log "$what: $((SECONDS - start))s"
}

image=${INVENTORY_IMAGE:-localhost/inventory}
profile=${INVENTORY_IMAGE_PROFILE:-release}
case $profile in
  dev) out=target/debug ;;
  *) out=target/$profile ;;
esac
base=debian:bookworm-slim # the Containerfile's FROM
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=target/image
mkdir -p "$work"

podman_settings

ensure_tools() {
  local missing=()
  command -v podman >/dev/null || missing+=(podman)
  [ -z "$PODMAN_RUNTIME" ] || command -v "$PODMAN_RUNTIME" >/dev/null || missing+=("$PODMAN_RUNTIME")
  if ! pod image exists "$base" 2>/dev/null; then
    command -v debootstrap >/dev/null || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
  fi
  if [ "${#missing[@]}" -gt 0 ]; then apt_install "${missing[@]}"; fi
}

# A base like the registry's debian:bookworm-slim: minbase, the slim image's dpkg excludes, and
# the updates and security suites, so that the Containerfile's apt-get gets current packages.
make_base() {
  if pod image exists "$base"; then
    log "base $base: found in podman's storage (cached)"
    return
  fi
  local rootfs
  rootfs=$(mktemp -d)
  log "base $base: debootstrap --variant=minbase bookworm (first time only; then cached)"
  as_root debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >&2
  as_root tee "$rootfs/etc/apt/sources.list" >/dev/null <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main
EOF
  as_root tee "$rootfs/etc/dpkg/dpkg.cfg.d/slim" >/dev/null <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
EOF
  as_root tee "$rootfs/etc/apt/apt.conf.d/docker-clean" >/dev/null <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  as_root find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  as_root find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
  as_root rm -rf "$rootfs"/usr/share/{groff,info,linda,locale,man}/* \
    "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/*
  as_root tar --numeric-owner -C "$rootfs" -c . | pod import --change 'CMD ["bash"]' - "localhost/$base" >&2
  as_root rm -rf "$rootfs"
}

# The service and the study beside it: the serving crates have no feature the study turns on,
# so the `inventory` of this build is the one a service-only build makes.
build_binaries() {
  cargo build --profile "$profile" --locked -p inventory-service -p inventory-benches --bins
}

build_image() {
  local context=$work/context previous
  previous=$(pod image inspect --format '{{.Id}}' "$image:latest" 2>/dev/null || true)
  rm -rf "$context"
  mkdir -p "$context"
  cp "$out/inventory" "$out/inventory-study" "$context/"
  pod build --file deploy/Containerfile \
    --build-arg VERSION="$version" --build-arg REVISION="$revision" --build-arg SOURCE="$source" \
    --tag "$image:$tag" --tag "$image:latest" "$context" >&2
  # The image this build replaced, once no tag names it (a container may still hold it).
  if [ -n "$previous" ] && [ "$(pod image inspect --format '{{len .RepoTags}}' "$previous")" = 0 ]; then
    pod rmi "$previous" >/dev/null 2>&1 || true
  fi
}

timed "podman, runc, debootstrap" ensure_tools
timed "base image" make_base
timed "$profile build" build_binaries

version=$("$out/inventory" --version | awk '{ print $2 }')
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
short=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
source=$(git remote get-url origin 2>/dev/null || true)
# The binaries are built from the work tree: say so when it is not the commit.
dirty=
if [ "$short" != unknown ] && ! git diff --quiet HEAD -- 2>/dev/null; then dirty=-dirty; fi
tag=$version-$short$dirty
[ "$profile" = release ] || tag=$tag-$profile

timed "image build" build_image
pod image ls "$image" >&2
printf '%s\n' "$image:$tag"
