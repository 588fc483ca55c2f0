#!/usr/bin/env bash
# The whole suite: tests/ and notebooks/ (under nbval) in two workers (how they share them: conftest.py);
# then the tests that measure time (marked `timing`) alone, so that nothing runs beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider)
WORKERS=${PIPEXPLORE_TEST_WORKERS:-2}
status=0
"${PYTEST[@]}" -n "$WORKERS" --dist loadfile -m "not timing" tests notebooks --nbval-lax \
    --nbval-sanitize-with notebooks/nbval_sanitize.cfg "$@" || status=$?
"${PYTEST[@]}" -m timing tests "$@" || status=$?
exit $status
