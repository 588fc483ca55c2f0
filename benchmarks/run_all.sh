#!/usr/bin/env bash
# Build the benchmark environment (.venv-bench: CPU torch, torchgpipe 0.0.7, pipexplore) and run every benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-bench/bin/python ]; then
    python3 -m venv .venv-bench
    .venv-bench/bin/pip install -q "torch==2.13.0" "torchgpipe==0.0.7" numpy
    .venv-bench/bin/pip install -q -e .
fi
cd benchmarks
for script in gpipe_vs_torchgpipe.py measure_predict.py prediction_accuracy.py explorer_responsiveness.py backend_batching.py executors.py; do
    echo "== $script"
    ../.venv-bench/bin/python "$script" "$@"
done
