"""How the suite shares its workers (``pytest -n 3 --dist loadfile``, see scripts/test.sh).

A file's tests run together in one worker, in order: a notebook's cells run in one kernel, the
browser tests share one JupyterLab, the worker-process tests one warm pool of rank processes,
other files their module fixtures. The files are handed out longest first (in the order below,
not pytest-xdist's own, which puts files of many tests first), so that no long file starts when
the other workers are about to run out of work.
"""
from __future__ import annotations

import pytest

#: The longest files first, as measured (seconds each file takes, on one worker of 2 cores:
#: test_cluster_roundtrip 66, test_jupyterlab 59 — ~100 beside other workers, as it waits on its
#: browser — test_forkserver 56, 03_schedules 26 — most of it asleep —, test_hf 24, … down to 1);
#: the others follow in their order.
LONGEST_FIRST = ("test_jupyterlab.py", "test_cluster_roundtrip.py", "test_forkserver.py", "test_hf.py",
                 "test_distributed_faults.py", "test_distributed.py", "test_trace_processes.py", "test_hf_defaults.py",
                 "test_trace.py", "test_schedule_csv.py", "04_beyond_sequential.ipynb", "test_schedule_orders.py",
                 "07_bring_a_run_back.ipynb", "test_explorer.py", "test_new_schedules.py", "03_schedules.ipynb",
                 "test_faults.py", "test_explorer_page.py", "test_profile_candidates.py", "test_traced_pipes.py",
                 "06_plan_a_cluster.ipynb", "02_skip_connections.ipynb",
                 "test_kineto.py", "test_dataflow.py", "05_expert_backends.ipynb", "01_quickstart.ipynb", "test_gpipe.py",
                 "test_cancel.py", "test_optimizer_phase.py", "test_torchgpipe_compat.py", "test_schedule.py",
                 "test_search.py", "test_state.py")


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist (3.6+) hands out files with the most tests first unless told not to: a file of
    # four browser tests (100 s) would then start last and run alone at the end.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: a file keeps its order

