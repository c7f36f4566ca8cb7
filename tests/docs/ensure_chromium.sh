#!/bin/sh
# Install Debian's chromium for the docs' rendering tests (tests/docs/), if it is missing.
# Needs root (as on CI); anyone else gets the command to run. About 30 s and 110 MB of
# downloads on a fresh Debian bookworm machine (apt-get update included).
set -eu
if command -v chromium >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
    echo "chromium is missing: install it (Debian: sudo apt-get install chromium)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get -q -o DPkg::Lock::Timeout=300 update >/dev/null
apt-get -q -y -o DPkg::Lock::Timeout=300 install --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null
