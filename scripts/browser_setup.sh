#!/usr/bin/env bash
# Install what the browser test tier drives: Debian's chromium and chromedriver (the tier's
# selenium comes with EDGETB_EXTRAS=...,browser). Run as root; safe to run again.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
echo "browser_setup: installing Debian packages chromium chromium-driver"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium chromium-driver >/dev/null
