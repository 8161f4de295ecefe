#!/usr/bin/env bash
# Make a Docker engine available on this Debian/Ubuntu host, as root. Safe to run again:
#   - installs docker.io, debootstrap and docker-compose from Debian when missing;
#   - starts dockerd in the background when no engine answers (log: /var/log/edgetb-dockerd.log),
#     with the overlay2 storage driver when an overlay mount really works here, vfs otherwise;
#   - waits until `docker info` answers (EDGETB_DOCKERD_TIMEOUT seconds, default 60).
# An engine that is already running (systemd, another script) is used as it is.
set -euo pipefail

log() { echo "docker_setup: $*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (sudo bash scripts/docker_setup.sh)"

DOCKERD_LOG=${EDGETB_DOCKERD_LOG:-/var/log/edgetb-dockerd.log}
TIMEOUT=${EDGETB_DOCKERD_TIMEOUT:-60}
DATA_ROOT=/var/lib/docker

# 1. packages ---------------------------------------------------------------------------------
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
# docker-compose.yml: Docker's compose plugin where it is installed, else Debian's docker-compose.
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || need+=(docker-compose)
if [ ${#need[@]} -gt 0 ]; then
  log "installing Debian packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # No init system runs the services here: let the packages install without starting them.
  policy=/usr/sbin/policy-rc.d
  created_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
    created_policy=1
  fi
  status=0
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/tmp/edgetb-docker-apt.log 2>&1 || status=$?
  [ "$created_policy" -eq 1 ] && rm -f "$policy"
  if [ "$status" -ne 0 ]; then
    cat /tmp/edgetb-docker-apt.log >&2
    die "apt-get install ${need[*]} failed (log above)"
  fi
fi
command -v dockerd >/dev/null || die "dockerd not found after installing docker.io"

# 2. engine -----------------------------------------------------------------------------------
engine_answers() { timeout 10 docker info >/dev/null 2>&1; }

if engine_answers; then
  log "Docker engine already running (storage driver: $(docker info --format '{{.Driver}}'))"
  exit 0
fi

# An overlay mount on the filesystem that holds the data root, tried for real.
overlay_works() {
  mkdir -p "$DATA_ROOT"
  local probe
  probe=$(mktemp -d "$DATA_ROOT/.edgetb-overlay-probe.XXXXXX")
  mkdir -p "$probe"/{lower,upper,work,merged}
  echo lower > "$probe/lower/file"
  local ok=1
  if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
       "$probe/merged" 2>/dev/null; then
    if echo upper > "$probe/merged/file" && [ "$(cat "$probe/lower/file")" = lower ] \
       && [ "$(cat "$probe/upper/file")" = upper ]; then
      ok=0
    fi
    umount "$probe/merged"
  fi
  rm -rf "$probe"
  return $ok
}

driver=${EDGETB_DOCKER_STORAGE_DRIVER:-}
if [ -z "$driver" ]; then
  if overlay_works; then driver=overlay2; else driver=vfs; fi
fi
log "storage driver: $driver"

if [ -S /var/run/docker.sock ] && ! pgrep -x dockerd >/dev/null; then
  rm -f /var/run/docker.sock  # stale socket of an engine that is gone
fi
started=0
if pgrep -x dockerd >/dev/null; then
  log "a dockerd process exists but does not answer yet; waiting for it"
else
  started=1
  log "starting dockerd (log: $DOCKERD_LOG)"
  mkdir -p "$(dirname "$DOCKERD_LOG")"
  setsid nohup dockerd --storage-driver "$driver" --data-root "$DATA_ROOT" \
    >>"$DOCKERD_LOG" 2>&1 < /dev/null &
fi

deadline=$((SECONDS + TIMEOUT))
until engine_answers; do
  if [ $SECONDS -ge $deadline ]; then
    tail -n 30 "$DOCKERD_LOG" >&2 || true
    die "dockerd did not answer 'docker info' within ${TIMEOUT}s (last lines of $DOCKERD_LOG above)"
  fi
  if ! pgrep -x dockerd >/dev/null; then
    tail -n 30 "$DOCKERD_LOG" >&2 || true
    die "dockerd exited during start-up (last lines of $DOCKERD_LOG above)"
  fi
  sleep 0.5
done
actual=$(docker info --format '{{.Driver}}')
[ "$started" -eq 0 ] || [ "$actual" = "$driver" ] || die "dockerd runs with storage driver $actual, not $driver"
log "Docker engine ready (storage driver: $actual, server $(docker version --format '{{.Server.Version}}'))"
