"""How the suite shares its workers (``pytest -n 3 --dist loadfile``, see scripts/test.sh).

A file's tests run together in one worker, in order: a notebook's cells run in one kernel, the
browser tests share one JupyterLab, the worker-process tests one warm pool of rank processes,
other files their module fixtures. The files are handed out longest first, so that no long file
starts when the other worker is about to run out of work.
"""
from __future__ import annotations

import pytest

#: The longest files first, as measured (seconds a worker spent on each, three workers on 2 cores, ranks
#: forked by the fork server: test_cluster_roundtrip 127, test_jupyterlab 125, test_trace 107,
#: test_distributed 97, … down to 7); the others follow in their order.
LONGEST_FIRST = ("test_cluster_roundtrip.py", "test_jupyterlab.py", "test_trace.py", "test_distributed.py",
                 "test_hf.py", "test_trace_processes.py", "test_hf_defaults.py", "07_bring_a_run_back.ipynb",
                 "test_distributed_faults.py", "test_explorer_page.py", "test_explorer.py", "test_new_schedules.py",
                 "03_schedules.ipynb", "test_forkserver.py", "04_beyond_sequential.ipynb", "test_schedule_csv.py",
                 "test_schedule_orders.py", "test_faults.py", "06_plan_a_cluster.ipynb", "test_cancel.py",
                 "test_kineto.py", "test_optimizer_phase.py", "05_expert_backends.ipynb",
                 "02_skip_connections.ipynb", "01_quickstart.ipynb", "test_torchgpipe_compat.py", "test_search.py",
                 "test_gpipe.py", "test_meta.py", "test_dataflow.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: a file keeps its order

