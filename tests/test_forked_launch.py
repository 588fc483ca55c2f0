"""The exported script's ranks forked here (pipexplore.runs.forked): torchrun's environment, one
process group, a failing rank named, a timeout and a cancel that leave nothing behind."""
import os
import textwrap
import threading

import pytest
from pipexplore.cancel import Cancelled, CancelToken, cancel_scope
from pipexplore.executors import pool
from pipexplore.host import core_share
from pipexplore.runs import forked
from pipexplore.runs.launch import STEP_LINE, TorchrunError, printed_losses
from ranks import script_ranks_left

SCRIPT = textwrap.dedent('''
    import os, sys, time
    import torch
    import torch.distributed as dist

    try:
        from forked_helper import VALUE  # (on the PYTHONPATH a test gives)
    except ImportError:
        VALUE = None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"env {os.environ['RANK']} {os.environ['LOCAL_RANK']} {os.environ['WORLD_SIZE']} "
          f"{os.environ['LOCAL_WORLD_SIZE']} {os.environ['GROUP_RANK']} threads={torch.get_num_threads()} "
          f"parent={os.getppid()} argv={sys.argv[1:]} main={__name__} helper={VALUE}")
    how = sys.argv[1] if len(sys.argv) > 1 else ""
    if how == "fail" and rank == 1:
        raise ValueError("rank 1 cannot go on")
    if how == "exit":
        raise SystemExit(f"rank {rank} leaves with a message" if rank else None)
    if how == "sleep":
        time.sleep(600)
    dist.barrier()
    if rank == world - 1:
        print(f"step 0 loss={total.item()} time=1.0ms")
    dist.destroy_process_group()
''')


def _script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_the_ranks_run_the_script_with_torchruns_environment_in_one_process_group(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "forked_helper.py").write_text("VALUE = 42\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path / "lib"))
    outcome = forked.launch_forked(_script(tmp_path), ranks=3, args=["go"], env=env, timeout=120)
    (stdout,) = outcome.stdout
    said = {int(line.split("]:env ")[1].split()[0]): line for line in stdout.splitlines() if "]:env " in line}
    assert sorted(said) == [0, 1, 2]
    server = pool.fork_server_pid()
    assert server is not None
    for rank, line in said.items():
        assert line.startswith(f"[default{rank}]:env {rank} {rank} 3 3 0 threads=1 parent={server} ")
        assert "argv=['go'] main=__main__ helper=42" in line  # PYTHONPATH's folders on the path, as at a start
    assert printed_losses(outcome.stdout) == {0: 6.0}  # 1 + 2 + 3, all-reduced over the three ranks
    assert len(STEP_LINE.findall(stdout)) == 1 and outcome.seconds > 0
    assert not script_ranks_left()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lib", "train.py"]  # nothing written beside it


def test_a_rank_that_fails_is_named_with_its_last_words_and_every_rank_is_reaped(tmp_path):
    with pytest.raises(TorchrunError, match=r"rank 1 on host \S+ exited with code 1") as caught:
        forked.launch_forked(_script(tmp_path), ranks=3, args=["fail"], timeout=120)
    assert caught.value.rank == 1 and caught.value.exitcode == 1
    assert "ValueError: rank 1 cannot go on" in str(caught.value)
    assert not script_ranks_left()


def test_of_ranks_that_failed_the_one_that_failed_first_is_named_in_whatever_order_they_were_reaped(tmp_path):
    """Each forked rank stamps the moment it failed on its stderr file: a rank that a peer's exit took
    down may be reaped before that peer (two cores, the server woken late), but it failed after it.
    Stamps alike: the order the server reaped them in decides."""
    class Reaped:
        def __init__(self, first):
            self.first = first

        def exited_first(self, failed):
            return self.first

    processes = [object(), object(), object()]
    errs = [tmp_path / f"rank{r}.err" for r in range(3)]
    for path, stamp in zip(errs, (2_000, 1_000, 3_000)):
        path.write_text("")
        os.utime(path, ns=(stamp, stamp))
    assert forked._failed_first(processes, processes[:2], errs, Reaped(processes[0])) is processes[1]
    assert forked._failed_first(processes, processes, errs, Reaped(processes[2])) is processes[1]
    os.utime(errs[0], ns=(1_000, 1_000))
    assert forked._failed_first(processes, processes[:2], errs, Reaped(processes[0])) is processes[0]
    assert forked._failed_first(processes, [], errs, Reaped(None)) is None


def test_a_rank_leaves_by_system_exit_as_an_interpreter_would(tmp_path):
    """SystemExit(None) is a clean exit; SystemExit("message") prints the message and exits 1."""
    with pytest.raises(TorchrunError, match=r"rank 1 on host \S+ exited with code 1:\nrank 1 leaves with a message"):
        forked.launch_forked(_script(tmp_path), ranks=2, args=["exit"], timeout=120)
    assert not script_ranks_left()


def test_a_run_past_its_timeout_is_stopped_whole(tmp_path):
    with pytest.raises(TorchrunError, match="took longer than 3 s and was stopped"):
        forked.launch_forked(_script(tmp_path), ranks=2, args=["sleep"], timeout=3)
    assert not script_ranks_left()


def test_a_cancelled_run_stops_every_rank(tmp_path):
    token = CancelToken()
    timer = threading.Timer(2.0, token.cancel)
    timer.start()
    try:
        said = []
        with cancel_scope(token), pytest.raises(Cancelled, match="cancelled; its ranks are stopped"):
            forked.launch_forked(_script(tmp_path), ranks=2, args=["sleep"], timeout=120, steps=4, progress=said.append)
    finally:
        timer.cancel()
    assert not script_ranks_left()
    assert said == ["2 ranks here starting (0 s)"]  # said once: no step was printed while they ran


def test_where_ranks_cannot_be_forked_one_torchrun_agent_starts_them(tmp_path, monkeypatch):
    asked = {}
    monkeypatch.setattr(pool, "FORK_SERVER", False)
    monkeypatch.setattr(forked, "launch", lambda script, **options: asked.update(options, script=script) or "ran")
    script = _script(tmp_path)
    assert forked.launch_forked(script, ranks=4, args=["go"], timeout=9, steps=3) == "ran"
    assert asked == {"script": script, "nodes": 1, "nproc_per_node": 4, "args": ["go"], "env": None, "timeout": 9,
                     "steps": 3, "progress": None}


def test_the_forked_ranks_get_the_intra_op_threads_their_share_of_the_cores(tmp_path):
    outcome = forked.launch_forked(_script(tmp_path), ranks=2, env={k: v for k, v in os.environ.items()
                                                                    if k != "OMP_NUM_THREADS"}, timeout=120)
    assert outcome.stdout[0].count(f"threads={core_share(2)} ") == 2, outcome.stdout
