#!/usr/bin/env bash
# Create the test environment: .venv with exactly the versions of requirements/test.lock (torch's
# CPU wheel among them), then pipexplore in editable mode. Idempotent: a second run only installs
# again when the lock or the package's build files changed (pyproject.toml, setup.py, the compiled
# simulator loop's source).
#
# LATEST=1 (`make test-latest`) builds .venv-latest instead, from pyproject.toml's ranges resolved
# to the newest releases today (torch still the pinned CPU wheel): the suite there tells whether
# the next `make lock` will be green.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=pins.sh
. scripts/pins.sh
PYTHON=${PYTHON:-python3}
LATEST=${LATEST:-0}
if [ "$LATEST" = 1 ]; then venv=.venv-latest; else venv=.venv; fi
if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
stamp=$venv/.pipexplore-installed
if [ "$LATEST" = 1 ]; then
    # every time: the newest releases change without a file here changing
    "${pip[@]}" install -q --upgrade pip
    "${pip[@]}" install -q "$TORCH_PIN"
    "${pip[@]}" install -q --upgrade --upgrade-strategy eager -e ".[test]"
    "${pip[@]}" install -q --upgrade --no-deps "$TORCHTITAN"
    "${pip[@]}" freeze --exclude-editable > "$venv/versions.txt"
    echo "$venv: the newest releases (list: $venv/versions.txt)"
elif [ ! -f "$stamp" ] || [ "$LOCK" -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
        || [ pipexplore/predict/_sharing.c -nt "$stamp" ]; then
    "${pip[@]}" install -q --upgrade pip
    # exactly the lock, nothing resolved here (the lock was resolved by `make lock`)
    "${pip[@]}" install -q --no-deps -r "$LOCK"
    "${pip[@]}" install -q --no-deps -e .
    touch "$stamp"
fi
