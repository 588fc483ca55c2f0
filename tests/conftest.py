from __future__ import annotations

import os
import signal
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def ctrl_c_raises():
    """Ctrl+C raises KeyboardInterrupt in the main thread, as in an interactive Python, whatever
    this process inherited (a shell without job control starts background jobs with SIGINT
    ignored, and Python then keeps it ignored)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


#: torch's process-wide module hooks (``torch.nn.modules.module``): a tracker (torch's ``ModTracker``,
#: ``CommDebugMode``, ``FlopCounterMode``) installs some for as long as it runs.
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                 "_global_backward_pre_hooks", "_global_backward_hooks", "_global_module_registration_hooks",
                 "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")


def global_state() -> dict[str, object]:
    """What a test could leave behind for the tests after it in the same process: torch's global
    module hooks, dispatch and function modes, a default process group, and this process's threads."""
    import torch.distributed as dist
    from torch.nn.modules import module

    state: dict[str, object] = {name: len(getattr(module, name, {})) for name in _GLOBAL_HOOKS}
    state["dispatch modes"] = torch._C._len_torch_dispatch_stack()
    state["function modes"] = torch._C._len_torch_function_stack()
    state["process group"] = dist.is_available() and dist.is_initialized()
    state["threads"] = {t.ident: t.name for t in threading.enumerate()}
    return state


#: Threads of other libraries' process-wide singletons, which live as long as the process by their
#: design: IPython's shell (the magics' tests create it once) saves its history in one; tqdm's monitor
#: wakes every ten seconds and ends once no progress bar is left.
_SINGLETON_THREADS = ("IPythonHistorySavingThread", "tqdm_monitor")


def _left_threads(before: dict, grace: float = 5.0, kept: tuple = ()) -> dict:
    """Threads started since ``before`` that are still alive after up to ``grace`` seconds (a
    stopped worker is given the time to finish), but for those whose names begin with one of
    ``kept``."""
    import time

    deadline = time.monotonic() + grace
    while True:
        left = {t.ident: t.name for t in threading.enumerate()
                if t.ident not in before and t.name not in _SINGLETON_THREADS and not t.name.startswith(kept)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def _no_global_state_left(request):
    """No test leaves a global module or dispatch hook, a process group or a thread of its own behind.
    Threads that a module's or the session's fixtures keep for their tests (a warm pool, a server)
    are theirs: only the threads a test starts with function-scoped fixtures are held to it. A
    module whose fixture keeps threads that start as its tests use it names them (the beginnings of
    their names) in ``MODULE_THREADS``."""
    before = global_state()
    yield
    after = global_state()
    threads_before = before.pop("threads")
    after.pop("threads")
    assert after == before, f"{request.node.nodeid} left global state behind: " + ", ".join(
        f"{key} {before[key]} -> {after[key]}" for key in before if before[key] != after[key])
    if "leaves_threads" not in request.keywords:
        left = _left_threads(threads_before, kept=tuple(getattr(request.module, "MODULE_THREADS", ())))  # type: ignore[arg-type]
        assert not left, f"{request.node.nodeid} left threads running: {sorted(left.values())}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _nothing_left_at_the_end():
    """The fork server outlives a module's pools (each module stops its ranks: ``ranks.py``); at
    the session's end it is stopped, and no rank or server of ours may still run."""
    yield
    from pipexplore.executors.pool import shutdown_pool
    from ranks import fork_server_left, worker_children

    shutdown_pool()
    assert worker_children() == [] and fork_server_left() == []
