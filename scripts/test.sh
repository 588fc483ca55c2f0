#!/usr/bin/env bash
# The whole suite: tests/ and notebooks/ (under nbval) in three workers on the machine's cores (how
# they share them: conftest.py; much of a worker's time is spent waiting on the processes, kernels
# and browser it starts); then the tests that measure time (marked `timing`) alone, so that nothing
# runs beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
# (-p tests.boot: loaded before pytest's plugins, it keeps nbformat's IRI grammar out of every pytest process)
# (VENV: the environment to test, .venv by default; `make test-latest` passes .venv-latest)
VENV=${VENV:-.venv}
PYTEST=("$VENV/bin/python" -m pytest -q -p no:cacheprovider -p tests.boot)
WORKERS=${PIPEXPLORE_TEST_WORKERS:-3}
# the files that hold timing tests (the mark is named where it is used)
TIMING_FILES=$(grep -lE "mark\.timing|^@timing" tests/test_*.py)
status=0
# The package's types first ([tool.mypy] in pyproject.toml says what is checked).
"$VENV/bin/python" -m mypy || status=$?
# The suite's processes (three workers, some thirty ranks, ten kernels) each import the package and
# the tests: where the environment turns bytecode caches off (PYTHONDONTWRITEBYTECODE), each compiles
# them again, and pytest rewrites every test module's asserts again (a worker's collection: 22 s of
# CPU against 11.5 s with the caches, measured). The caches go to __pycache__ here (git ignores them).
unset PYTHONDONTWRITEBYTECODE
# Three workers (and the ranks, kernels and browser they start) on two cores: an OpenMP thread that
# waits spins for a while before it sleeps, burning a core another worker needs (the parallel part
# took ~100 CPU s and ~50 s more with the default policy, measured). Threads that wait sleep here;
# the timing tests, alone on the machine, run with torch's defaults.
# (--durations: the slowest tests of the run, where a slow run shows what was slow)
OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} \
"${PYTEST[@]}" -n "$WORKERS" --dist loadfile -m "not timing" tests notebooks --nbval-lax \
    --nbval-sanitize-with notebooks/nbval_sanitize.cfg --durations=25 "$@" || status=$?
# (no notebooks here: nbval's import, 1.6 s of nbformat's schema checker, is left out)
# shellcheck disable=SC2086
"${PYTEST[@]}" -p no:nbval -m timing $TIMING_FILES "$@" || status=$?
exit $status
