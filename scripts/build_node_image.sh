#!/usr/bin/env bash
# Build the Docker node image offline, from Debian's packages only (no image registry needed):
# debootstrap a minimal Debian rootfs with what dml_app needs (python3, numpy, gevent) plus a few
# network tools for tests and debugging, then `docker import` it. Run as root, after
# scripts/docker_setup.sh. Safe to run again: an existing tag is reused as it is.
#
#   EDGETB_NODE_IMAGE   image tag (default edgetb-node:bookworm-1; worker/nodes/docker.py uses the same)
#   EDGETB_DEBIAN_MIRROR  Debian mirror (default http://deb.debian.org/debian)
#   --force             rebuild even when the tag exists
#
# Downloaded packages are kept in /var/cache/edgetb/debootstrap, so a rebuild needs no download.
# Machines that reach Docker Hub can build worker/Dockerfile instead (same contents, same tag).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "build_node_image: $*" >&2; }
die() { log "error: $*"; exit 1; }

IMAGE=${EDGETB_NODE_IMAGE:-edgetb-node:bookworm-1}
SUITE=bookworm
MIRROR=${EDGETB_DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=/var/cache/edgetb/debootstrap
# What dml_app imports (numpy, gevent, the stdlib) and the tools tests run inside nodes.
PACKAGES=python3,python3-numpy,python3-gevent,iproute2,iputils-ping,iperf3,procps,ca-certificates
force=0
[ "${1:-}" = "--force" ] && force=1

[ "$(id -u)" -eq 0 ] || die "run as root (sudo bash scripts/build_node_image.sh)"
command -v debootstrap >/dev/null || die "debootstrap is missing: run bash scripts/docker_setup.sh first"
timeout 10 docker info >/dev/null 2>&1 || die "no Docker engine answers: run bash scripts/docker_setup.sh first"

if [ "$force" -eq 0 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "$IMAGE exists ($(docker image inspect --format '{{.Id}}' "$IMAGE" | cut -c1-19)); nothing to do"
  exit 0
fi

mkdir -p "$CACHE"
work=$(mktemp -d /var/tmp/edgetb-rootfs.XXXXXX)
cleanup() { rm -rf --one-file-system "$work"; }
trap cleanup EXIT
rootfs="$work/rootfs"

started=$SECONDS
log "debootstrap $SUITE ($PACKAGES) from $MIRROR"
if ! debootstrap --variant=minbase --include="$PACKAGES" --cache-dir="$CACHE" \
     "$SUITE" "$rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1; then
  tail -n 40 "$work/debootstrap.log" >&2
  [ -f "$rootfs/debootstrap/debootstrap.log" ] && tail -n 40 "$rootfs/debootstrap/debootstrap.log" >&2
  die "debootstrap failed (last lines above)"
fi

# Slim it: package caches and lists, docs, man pages, locales other than C (what docker's debian images drop).
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
       "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
       "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log "$rootfs"/debootstrap
# The image is a plain filesystem: no services start in it.
rm -f "$rootfs"/etc/hostname "$rootfs"/etc/resolv.conf
chroot "$rootfs" python3 -c 'import numpy, gevent, gevent.pywsgi; print("numpy", numpy.__version__, "gevent", gevent.__version__)' >&2 \
  || die "python3 with numpy and gevent does not run in the rootfs"

log "importing as $IMAGE"
tar --numeric-owner -C "$rootfs" -c . | docker import \
  --change 'CMD ["sleep", "infinity"]' \
  --change 'ENV PYTHONDONTWRITEBYTECODE=1 LANG=C.UTF-8' \
  --change 'LABEL org.edgetb.node-image=1' \
  --message "edgetb node image: debootstrap $SUITE minbase + $PACKAGES" \
  - "$IMAGE" >/dev/null
log "built $IMAGE in $((SECONDS - started)) s ($(docker image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
