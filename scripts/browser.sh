#!/usr/bin/env bash
# The browser test drives Debian's Chromium (browsers cannot be downloaded by Playwright here).
# Install it with apt when it is missing.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "browser test: /usr/bin/chromium is missing and apt-get is not available; install Chromium" >&2
    exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
