#!/usr/bin/env bash
# Build the benchmark environment (.venv-bench: CPU torch, torchgpipe 0.0.7, transformers, pipexplore) and run
# every benchmark. Arguments (e.g. --devices cuda:0,cuda:1) go to each script.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv-bench/.installed-with-test-extras  # transformers, for gpt2_explore.py and mesh_rerun.py
if [ ! -f "$stamp" ]; then
    [ -x .venv-bench/bin/python ] || python3 -m venv .venv-bench
    .venv-bench/bin/pip install -q "torch==2.13.0" "torchgpipe==0.0.7" numpy
    .venv-bench/bin/pip install -q -e ".[test]"
    touch "$stamp"
fi
cd benchmarks
for script in gpipe_vs_torchgpipe.py measure_predict.py prediction_accuracy.py explorer_responsiveness.py backend_batching.py executors.py \
        gpt2_explore.py browser_responsiveness.py cluster_roundtrip.py plan_at_scale.py plan_accuracy.py search.py \
        pool_start.py traced_rerun.py mesh_rerun.py gpu_checks.py; do
    echo "== $script"
    ../.venv-bench/bin/python "$script" "$@"
done
