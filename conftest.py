"""How the suite shares its workers (``pytest -n 3 --dist loadfile``, see scripts/test.sh).

A file's tests run together in one worker, in order: a notebook's cells run in one kernel, the
browser tests share one JupyterLab, the worker-process tests one warm pool of rank processes,
other files their module fixtures. The files are handed out longest first, so that no long file
starts when the other worker is about to run out of work.
"""
from __future__ import annotations

import pytest

#: The longest files first, as measured (seconds a worker spent on each, three workers on 2 cores, ranks
#: forked by the fork server: test_cluster_roundtrip 114, test_jupyterlab 102, test_hf 85,
#: test_trace_processes 82, test_forkserver 80, … down to 6); the others follow in their order.
LONGEST_FIRST = ("test_cluster_roundtrip.py", "test_jupyterlab.py", "test_hf.py", "test_trace_processes.py",
                 "test_forkserver.py", "test_trace.py", "test_distributed.py", "test_distributed_faults.py",
                 "07_bring_a_run_back.ipynb", "test_explorer.py", "test_hf_defaults.py", "03_schedules.ipynb",
                 "test_new_schedules.py", "04_beyond_sequential.ipynb", "test_schedule_orders.py",
                 "test_schedule_csv.py", "test_explorer_page.py", "test_faults.py", "test_torchgpipe_compat.py",
                 "test_kineto.py", "05_expert_backends.ipynb", "06_plan_a_cluster.ipynb", "02_skip_connections.ipynb",
                 "test_optimizer_phase.py", "test_cancel.py", "01_quickstart.ipynb", "test_gpipe.py", "test_meta.py",
                 "test_dataflow.py", "test_search.py", "test_schedule.py", "test_planned.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: a file keeps its order

