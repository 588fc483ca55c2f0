"""How the suite shares its workers (``pytest -n 3 --dist loadfile``, see scripts/test.sh).

A file's tests run together in one worker, in order: a notebook's cells run in one kernel, the
browser tests share one JupyterLab, the worker-process tests one warm pool of rank processes,
other files their module fixtures. The files are handed out longest first (in the order below,
not pytest-xdist's own, which puts files of many tests first), so that no long file starts when
the other workers are about to run out of work.
"""
from __future__ import annotations

import pytest

#: The longest files first, as measured: the CPU seconds of each file's tests and of the processes
#: they start (2026-12-06, three workers on 2 cores: 07_bring_a_run_back 109, test_mesh_here 91,
#: test_cluster_roundtrip 65, test_zoo 57, test_jupyterlab 53 — ~100 s of wall alone, as it waits on
#: its browser, so first —, test_mesh_torchrun 44, 03_schedules 9 — 26 s of wall, most of it asleep —, …
#: down to 4); the others (under 4 s each) follow in their order. A long file left out starts last
#: and runs alone at the end (test_zoo did: ~50 s of one worker's tail).
LONGEST_FIRST = ("test_jupyterlab.py", "07_bring_a_run_back.ipynb", "test_mesh_here.py",
                 "test_cluster_roundtrip.py", "test_zoo.py", "test_mesh_torchrun.py", "03_schedules.ipynb",
                 "test_forkserver.py", "test_hf_defaults.py", "test_hf.py", "test_distributed.py",
                 "04_beyond_sequential.ipynb", "test_sharded.py", "test_traced_pipes.py", "test_trace_processes.py",
                 "test_explorer.py", "test_profile_candidates.py", "test_trace.py", "test_distributed_faults.py",
                 "test_torchrun_experts.py", "test_zoo_processes.py", "test_export_moe.py", "test_mesh_experts.py",
                 "06_plan_a_cluster.ipynb", "test_explorer_page.py", "test_schedule_csv.py",
                 "test_schedule_orders.py", "test_torchrun_export.py", "test_new_schedules.py", "test_kernels.py",
                 "test_dataflow.py", "02_skip_connections.ipynb", "01_quickstart.ipynb", "05_expert_backends.ipynb",
                 "test_gpipe.py", "test_kineto.py", "test_weights.py", "test_mesh_plan.py")


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist (3.6+) hands out files with the most tests first unless told not to: a file of
    # four browser tests (100 s) would then start last and run alone at the end.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: a file keeps its order

