#!/usr/bin/env bash
# Set up (with TensorFlow and PyTorch, for the Keras and torch models' tests, the Docker SDK and selenium), then run every test
# tier (unit, netns, docker, swarm, e2e, security, browser). Run as root.
# Without arguments it also builds the documentation site strictly (scripts/docs.sh: the docs extra).
# The docker tier needs an engine and the node image: this script installs docker.io, starts dockerd
# (scripts/docker_setup.sh) and builds the images offline (scripts/build_node_image.sh, reused by
# tag; scripts/build_testbed_image.sh for docker-compose.yml), then requires the tier to run.
# EDGETB_DOCKER=0 leaves Docker alone: the tier then skips itself with the reason.
# Without arguments it then runs the vm tier (scripts/vm_test.sh: tests/vm in a qemu guest on
# Debian's stock kernel, with sch_netem and cgroup v2); EDGETB_VM=0 leaves it out.
set -euo pipefail
cd "$(dirname "$0")/.."
EDGETB_EXTRAS=${EDGETB_EXTRAS:-test,tf,torch,docker,browser,docs} bash scripts/setup.sh
# the browser tier drives Debian's chromium (scripts/browser_setup.sh); EDGETB_BROWSER=0 lets it skip
if [ "${EDGETB_BROWSER:-1}" != 0 ]; then
  bash scripts/browser_setup.sh
  export EDGETB_REQUIRE_BROWSER=1
fi
# the Flower runs (tests/e2e/test_flower*.py, docs/how-to/flower.md) need flwr in a venv of its own,
# with torch for examples/flower/torch_app; EDGETB_FLOWER=0 lets them skip
if [ "${EDGETB_FLOWER:-1}" != 0 ]; then
  EDGETB_FLWR_TORCH=${EDGETB_FLWR_TORCH:-1} bash scripts/flower_setup.sh
  export EDGETB_REQUIRE_FLOWER=1
fi
if [ "${EDGETB_DOCKER:-1}" != 0 ]; then
  bash scripts/docker_setup.sh
  bash scripts/build_node_image.sh
  bash scripts/build_testbed_image.sh  # docker-compose.yml's agent and controller
  export EDGETB_REQUIRE_DOCKER=1
fi
rc=0
.venv/bin/python -m pytest -ra "$@" || rc=$?
# the documentation site, built offline and strictly (a broken link or a missing page fails)
if [ $# -eq 0 ]; then
  bash scripts/docs.sh || { docs_rc=$?; [ "$rc" -ne 0 ] || rc=$docs_rc; }
fi
# the vm tier (tests/vm) on Debian's stock kernel in qemu: once, when the whole suite runs
if [ "${EDGETB_VM:-1}" != 0 ] && [ $# -eq 0 ]; then
  bash scripts/vm_test.sh || { vm_rc=$?; [ "$rc" -ne 0 ] || rc=$vm_rc; }
fi
exit "$rc"
