#!/usr/bin/env bash
# Set up (with TensorFlow, for the TF model's test, the Docker SDK and selenium), then run every test
# tier (unit, netns, docker, e2e, security, browser). Run as root.
# The docker tier needs an engine and the node image: this script installs docker.io, starts dockerd
# (scripts/docker_setup.sh) and builds the images offline (scripts/build_node_image.sh, reused by
# tag; scripts/build_testbed_image.sh for docker-compose.yml), then requires the tier to run.
# EDGETB_DOCKER=0 leaves Docker alone: the tier then skips itself with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
EDGETB_EXTRAS=${EDGETB_EXTRAS:-test,tf,docker,browser} bash scripts/setup.sh
# the browser tier drives Debian's chromium (scripts/browser_setup.sh); EDGETB_BROWSER=0 lets it skip
if [ "${EDGETB_BROWSER:-1}" != 0 ]; then
  bash scripts/browser_setup.sh
  export EDGETB_REQUIRE_BROWSER=1
fi
if [ "${EDGETB_DOCKER:-1}" != 0 ]; then
  bash scripts/docker_setup.sh
  bash scripts/build_node_image.sh
  bash scripts/build_testbed_image.sh  # docker-compose.yml's agent and controller
  export EDGETB_REQUIRE_DOCKER=1
fi
exec .venv/bin/python -m pytest -ra "$@"
