#!/usr/bin/env bash
# Create .venv with the CPU build of torch and pipexplore (editable) with its test extras.
# Idempotent: a second run only re-installs when the package's build files changed (pyproject.toml,
# setup.py, or the compiled simulator loop's source).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.pipexplore-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
        || [ pipexplore/predict/_sharing.c -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU wheel, pinned: a loose `torch` would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[test]"
    # torchtitan's config dataclasses and parsing rules check the exported torchtitan command
    # (tests/test_torchtitan_export.py); its training dependencies (datasets, wandb, triton kernels) are
    # not needed for that, and are left out.
    .venv/bin/python -m pip install -q --no-deps "torchtitan==0.3.0"
    touch "$stamp"
fi
