#!/usr/bin/env bash
# Build the testbed image (the controller and the worker agent, as docker-compose.yml runs them)
# with no image registry: the offline equivalent of the top-level Dockerfile. Run as root, after
# scripts/docker_setup.sh.
#
#   1. the node image (scripts/build_node_image.sh; Debian's python3, reused by tag);
#   2. a dependencies image: the node image plus the wheels of pyproject.toml's requirements
#      (scripts/deps.py), downloaded from PyPI once into /var/cache/edgetb/wheels-<hash> and
#      installed with no network; tagged by the hash of the requirements, so it is reused until
#      they change;
#   3. the code of this checkout copied on top, tagged $EDGETB_TESTBED_IMAGE
#      (default edgetb-testbed:local, the tag docker-compose.yml runs). Made anew every time: cheap.
#
# Neither step needs BuildKit or a base image from a registry (docker run + docker commit).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "build_testbed_image: $*" >&2; }
die() { log "error: $*"; exit 1; }

IMAGE=${EDGETB_TESTBED_IMAGE:-edgetb-testbed:local}
NODE_IMAGE=${EDGETB_NODE_IMAGE:-edgetb-node:bookworm-1}
CACHE=/var/cache/edgetb
if [ -z "${PYTHON:-}" ]; then  # runs scripts/deps.py and pip download: the venv's when there is one
  PYTHON=python3
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi

[ "$(id -u)" -eq 0 ] || die "run as root (sudo bash scripts/build_testbed_image.sh)"
timeout 10 docker info >/dev/null 2>&1 || die "no Docker engine answers: run bash scripts/docker_setup.sh first"
bash scripts/build_node_image.sh

mapfile -t requirements < <("$PYTHON" scripts/deps.py docker)
[ ${#requirements[@]} -gt 0 ] || die "no requirements read from pyproject.toml"
arch=$(uname -m)
node_id=$(docker image inspect --format '{{.Id}}' "$NODE_IMAGE")
hash=$(printf '%s\n' "$node_id" "$arch" "${requirements[@]}" | sha256sum | cut -c1-12)
DEPS_IMAGE=edgetb-testbed-deps:$hash
started=$SECONDS

cid=""
cleanup() { [ -n "$cid" ] && docker rm -f "$cid" >/dev/null 2>&1 || true; }
trap cleanup EXIT

# 2. dependencies ------------------------------------------------------------------------------
if docker image inspect "$DEPS_IMAGE" >/dev/null 2>&1; then
  log "$DEPS_IMAGE exists; reused"
else
  wheels=$CACHE/wheels-$hash
  if [ ! -f "$wheels/.complete" ]; then
    log "downloading wheels for Python 3.11 ($arch) into $wheels: ${requirements[*]}"
    rm -rf "$wheels" && mkdir -p "$wheels"
    platforms=(--platform "manylinux2014_$arch")
    for v in 17 24 27 28 31 34 35 36; do platforms+=(--platform "manylinux_2_${v}_$arch"); done
    if ! "$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --dest "$wheels" \
         --python-version 3.11 --implementation cp --abi cp311 "${platforms[@]}" \
         pip "${requirements[@]}" >"$wheels.log" 2>&1; then
      cat "$wheels.log" >&2
      die "pip download failed (log above)"
    fi
    touch "$wheels/.complete"
  fi
  log "installing them into $NODE_IMAGE (no network)"
  cid=$(docker create --network none -v "$(realpath "$wheels"):/wheels:ro" "$NODE_IMAGE" \
        sh -c 'for w in /wheels/pip-*.whl; do pip=$w/pip; done; python3 "$pip" install --quiet --no-index --find-links /wheels \
               --break-system-packages --no-cache-dir --no-warn-script-location --root-user-action=ignore "$@" \
               && python3 -c "import flask, requests, pyroute2, gevent, numpy, sklearn, matplotlib, docker"' \
        sh "${requirements[@]}")
  docker start --attach "$cid" >&2 || die "installing the requirements in the image failed (output above)"
  docker commit --change 'CMD ["sleep", "infinity"]' "$cid" "$DEPS_IMAGE" >/dev/null
  docker rm "$cid" >/dev/null && cid=""
fi

# 3. this checkout's code ----------------------------------------------------------------------
previous=$(docker image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
cid=$(docker create "$DEPS_IMAGE" true)
tar -c --exclude-vcs --exclude=./.venv --exclude=./dml_file --exclude=__pycache__ --exclude=.pytest_cache \
    --exclude='*.egg-info' --exclude=./dataset --exclude=./build --transform 's,^\.,opt/edgetb,' . \
  | docker cp - "$cid:/"
docker commit \
  --change 'WORKDIR /opt/edgetb' \
  --change 'ENV PYTHONDONTWRITEBYTECODE=1 LANG=C.UTF-8 PYTHONPATH=/opt/edgetb' \
  --change 'LABEL org.edgetb.testbed-image=1' \
  --change 'CMD ["python3", "-m", "worker.agent", "--help"]' \
  "$cid" "$IMAGE" >/dev/null
docker rm "$cid" >/dev/null && cid=""
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect --format '{{.Id}}' "$IMAGE")" ]; then
  docker image rm "$previous" >/dev/null 2>&1 || true  # the code layer it replaces (kept while in use)
fi
log "built $IMAGE in $((SECONDS - started)) s (on $DEPS_IMAGE)"
