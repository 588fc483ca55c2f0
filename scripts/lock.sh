#!/usr/bin/env bash
# `make lock`: write requirements/test.lock, the exact versions `make test` installs, from
# pyproject.toml's `test` extra resolved afresh (the newest releases its ranges admit) in a new
# virtual environment, with torch's CPU wheel and torchtitan as scripts/pins.sh says.
# Run it, then `make test` (which installs the new lock), and commit the lock when the suite is green.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=pins.sh
. scripts/pins.sh
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q "$TORCH_PIN"
"${pip[@]}" install -q ".[test]"
"${pip[@]}" install -q --no-deps "$TORCHTITAN"
{
    echo "# The test environment, exact: written by \`make lock\` (scripts/lock.sh) from pyproject.toml's"
    echo "# test extra on $("$work/venv/bin/python" -c 'import platform; print("CPython", platform.python_version(), "on", platform.system(), platform.machine())')."
    echo "# scripts/setup.sh installs it as it is (--no-deps); docs/contributing.md says how to refresh it."
    # torch as pinned (the CPU wheel's local version, +cpu, is not on the index the pin is read from)
    "${pip[@]}" freeze --exclude-editable --exclude pipexplore | sed -E 's/^torch==([^+]+)\+cpu$/torch==\1/'
} > "$LOCK.new"
mv "$LOCK.new" "$LOCK"
echo "wrote $LOCK ($(grep -vc '^#' "$LOCK") packages)"
