#!/usr/bin/env bash
# What the tests need beside Python: Debian's Chromium (the browser test; browsers cannot be
# downloaded by Playwright here) and Node.js (runs the page's re-timing code, retime.js).
# Installs what is missing with apt.
set -euo pipefail
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v node >/dev/null 2>&1 || missing+=(nodejs)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "tests: ${missing[*]} missing and apt-get is not available; install them" >&2
    exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
