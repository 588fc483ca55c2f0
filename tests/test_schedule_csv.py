"""Schedules as CSV files in torch's format: read and checked with clear refusals, written so that
torch's own reader reads them, predicted as the schedule they were written from, run by threads and
by processes (torch's ``_PipelineScheduleRuntime``), and exported."""
from __future__ import annotations

import copy
import os
from unittest import mock

import pandas as pd
import pytest
import torch
from torch import nn

from models import plain_model
from pipexplore import timeline as tl
from pipexplore.executors.threads import ScheduleExecutor
from pipexplore.export import plan_code
from pipexplore.plan import Plan
from pipexplore.predict.simulator import simulate
from pipexplore.schedules.csv_files import load_csv, parse_csv_text, to_csv_text, write_csv
from pipexplore import schedules
from pipexplore.schedules import actions, csv_schedule, rank_orders, worker_orders

from ranks import no_pool_left_behind  # noqa: F401  (every pool of rank processes gone after the module)


def _write(tmp_path, text, name="my.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _refusal(tmp_path, text, **options):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as caught:
        load_csv(path, **options)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    return message[len(path) + 2:]


def _table(n=8):
    return pd.DataFrame({"name": [str(k) for k in range(n)], "forward": 1e-3, "backward": 2e-3,
                         "output_bytes": 1e3, "param_bytes": 1e3})


def _torch_reads(path, ranks, stages, microbatches, format="compute_only"):
    """What torch's runtime reads from ``path`` (``_load_csv``, then its lowering to sends and
    receives), on stand-in stages as torch's own ``_schedule_visualizer`` makes them."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, ranks, None, stages
    runtime = _PipelineScheduleRuntime([stage], microbatches)
    runtime._load_csv(path, format=format)
    assert len(runtime.pipeline_order_with_comms) == ranks  # lowered to sends and receives without a hang
    read = runtime.pipeline_order if format == "compute_only" else runtime.pipeline_order_with_comms
    return [[str(a) for a in read[r] if a is not None and a.is_compute_op] for r in range(ranks)], runtime


# ---- reading: cells it cannot read, by line and column -------------------------------------------

@pytest.mark.parametrize("text,message", [
    ("0F0,0B0\n1F0,1X0,1B0\n", "line 2, column 2: cannot read '1X0' as an action: write {stage}{F|I|B|W}"
                               "{micro-batch}, such as 1B3, or leave the cell empty for an idle step"),
    ("0F0, 0B0 ,0F1,F1\n", "line 1, column 4: cannot read 'F1' as an action: write {stage}{F|I|B|W}{micro-batch}, "
                           "such as 1B3, or leave the cell empty for an idle step"),
    ("0F0,0B0x\n", "line 1, column 2: cannot read '0B0x' as an action: write {stage}{F|I|B|W}{micro-batch}, "
                   "such as 1B3, or leave the cell empty for an idle step"),
    ("0F0,,0B\n", "line 1, column 3: '0B' names no micro-batch: a compute action is {stage}{F|I|B|W}{micro-batch}, "
                  "such as 0B0"),
    ("0F0,0SEND_F0,0B0\n1F0,1B0\n", "line 1, column 2: '0SEND_F0' is a communication action, which format "
                                    "'compute_only' does not take: read the file with format='compute_comms' (every "
                                    "send and receive written out), or leave them out for torch to add"),
    ("0F0,0B0\n\n1F0,1B0\n", "rank 1 (line 2) runs no compute action: every rank holds at least one stage"),
])
def test_a_cell_that_cannot_be_read_is_named_by_line_and_column(tmp_path, text, message):
    assert _refusal(tmp_path, text) == message


# ---- checking: what cannot run, named where it is ----------------------------------------------

def test_an_action_whose_input_no_rank_runs_is_named_by_its_cell(tmp_path):
    text = ("0F0,0F1,0F2,0F3,,0B0,0B1,0B2,0B3\n"
            "1F0,1F1,1F2,1F3,1B0,1B1,1B3,1B2\n"
            "2F0,2B0,2F1,2B1,2F2,2B2,2F3\n")  # no 2B3
    assert _refusal(tmp_path, text) == "rank 1, step 7: 1B3 waits for 2B3, which no rank runs"


@pytest.mark.parametrize("text,message", [
    # an action before its own input on the same rank
    ("0F0,0B0\n1B0,1F0\n", "rank 1, step 1: 1B0 waits for 1F0, which rank 1 runs only at step 2, after it: "
                           "a deadlock, no rank can go on"),
    # two ranks each waiting for the other
    ("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n",
     "rank 1, step 1: 1F1 waits for 0F1, which rank 0 runs only at step 3, after 0B0 (step 2), which waits for 1B0, "
     "which rank 1 runs only at step 3, after it: a deadlock, no rank can go on"),
    # a weight gradient before its input gradient
    ("0F0,0W0,0I0\n1F0,1B0\n", "rank 0, step 2: 0W0 waits for 0I0, which rank 0 runs only at step 3, after it: "
                               "a deadlock, no rank can go on"),
])
def test_a_schedule_that_would_wait_forever_says_who_waits_for_whom(tmp_path, text, message):
    assert _refusal(tmp_path, text) == message


@pytest.mark.parametrize("text,message", [
    ("0F0,1B0\n1F0,0B0\n", "stage 1 sits on rank 0 (1B0 at step 2) and on rank 1 (1F0 at step 1): each stage runs "
                           "on exactly one rank"),
    ("0F0,0F0,0B0\n1F0,1B0\n", "0F0 appears twice, at rank 0, step 1 and rank 0, step 2: each action runs exactly "
                               "once"),
    ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", "stage 0 has no backward of micro-batch 1: give it 0B1, or 0I1 and 0W1"),
    ("0F1,0B1\n", "stage 0 has no forward of micro-batch 0 (0F0): every stage runs each micro-batch (0 … 1) once "
                   "forward and once backward"),
    ("0F0,0I0\n1F0,1B0\n", "stage 0 has 0I0 (rank 0, step 2) but no 0W0: an input-gradient action (I) needs its "
                           "weight-gradient action (W)"),
    ("0F0,0B0,0I0,0W0\n1F0,1B0\n", "stage 0 runs micro-batch 0's backward twice, as 0B0 (rank 0, step 2) and 0I0 "
                                   "(rank 0, step 3): a backward is one B, or one I and one W"),
    # B and W without I: refused as the doubled backward it is, not as a W waiting for an I
    ("0F0,0B0,0W0\n1F0,1B0\n", "stage 0 runs micro-batch 0's backward twice, as 0B0 (rank 0, step 2) and 0W0 "
                               "(rank 0, step 3): a backward is one B, or one I and one W"),
    ("0F0,0B0\n2F0,2B0\n", "stage 1 appears on no rank: stages are numbered from 0 with none missing (found 0, 2)"),
])
def test_every_stage_on_one_rank_and_every_micro_batch_once_forward_and_once_backward(tmp_path, text, message):
    assert _refusal(tmp_path, text) == message


def test_a_schedule_that_does_not_fit_the_plan_says_what_it_expected_and_got(tmp_path):
    path = write_csv(rank_orders("1f1b", 4, 8), tmp_path / "four.csv")
    with pytest.raises(ValueError) as caught:
        Plan(_table(), splits=(4,), chunks=4, schedule=path)
    assert str(caught.value) == (f"schedule {path} does not fit the plan: expected 2 stages and 4 micro-batches "
                                 "(the plan's stages and chunks), got 4 stages and 8 micro-batches in the file")
    with pytest.raises(ValueError, match=r"expected 4 ranks \(the plan's devices\), got 2 ranks"):
        load_csv(write_csv(rank_orders("zbv", 2, 4), tmp_path / "v.csv")).check_fits(ranks=4)
    assert schedules.refusal(path, 4, 4) == (f"schedule {path} does not fit the plan: expected 4 micro-batches "
                                             "(the plan's chunks), got 8 micro-batches in the file")


def test_an_unknown_schedule_lists_the_known_ones_and_a_csv_path(tmp_path):
    with pytest.raises(ValueError) as caught:
        Plan(_table(), splits=(4,), schedule="1f1b-typo")
    assert str(caught.value) == ("unknown schedule '1f1b-typo': choose one of gpipe, 1f1b, interleaved, zero-bubble, "
                                 "looped-bfs, interleaved-zero-bubble, zbv, dualpipev, async-backends, or give the "
                                 "path of a .csv file (a schedule in torch's CSV format)")
    with pytest.raises(ValueError, match=r"choose one of gpipe, .*dualpipev, or give the path of a \.csv file"):
        schedules.worker_orders("1f1b-typo", 2, 2)
    with pytest.raises(FileNotFoundError, match="schedule file 'nowhere.csv' not found"):
        Plan(_table(), splits=(4,), schedule="nowhere.csv")


# ---- writing: torch reads what we write ----------------------------------------------------------

@pytest.mark.parametrize("schedule,ranks,m,v", [("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("interleaved", 2, 6, 3),
                                                ("zbv", 2, 4, 2), ("zbv", 4, 8, 2), ("dualpipev", 2, 4, 2),
                                                ("dualpipev", 3, 8, 2)])
def test_our_orders_written_read_back_by_torch_and_by_us_are_the_same_actions(tmp_path, schedule, ranks, m, v):
    orders = rank_orders(schedule, ranks, m, v)
    path = write_csv(orders, tmp_path / f"{schedule}.csv")
    read, runtime = _torch_reads(path, ranks, ranks * v, m)
    assert read == actions(schedule, ranks, m, v)
    assert runtime.stage_index_to_group_rank == dict(enumerate(schedules.stage_ranks(schedule, ranks * v, ranks)))
    ours = load_csv(path)
    assert ours.orders() == orders and ours.microbatches == m and ours.stages == ranks * v
    assert ours.split_backward == (schedule in schedules.SPLIT_BACKWARD)
    assert list(ours.stage_ranks) == schedules.stage_ranks(schedule, ranks * v, ranks)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "interleaved", "zbv", "dualpipev"])
def test_the_plans_schedule_exported_as_csv_is_read_by_torch(tmp_path, schedule):
    multi = schedule in schedules.MULTI_STAGE
    plan = Plan(_table(), splits=(2, 4, 6), devices=("cpu",) * (2 if multi else 4), chunks=4, schedule=schedule,
                executor="threads")
    text = plan_code(plan, "schedule-csv")
    path = _write(tmp_path, text, f"{schedule}.csv")
    read, _ = _torch_reads(path, plan.num_devices, 4, 4)
    assert read == [[f"{s}{k}{i}" for s, k, i in order] for order in worker_orders(schedule, 4, 4, 2 if multi else 1)]
    again = plan.with_options(schedule=path)
    assert again.num_devices == plan.num_devices and again.stage_devices == plan.stage_devices
    assert plan_code(again, "schedule-csv") == text  # a CSV plan exports its file as written


def test_torchs_lowered_schedule_with_its_sends_and_receives_is_read_and_kept(tmp_path):
    path = write_csv(rank_orders("zbv", 2, 4), tmp_path / "zbv.csv")
    _, runtime = _torch_reads(path, 2, 4, 4)
    comms_path = write_csv([list(map(str, runtime.pipeline_order_with_comms[r])) for r in range(2)],
                           tmp_path / "zbv-comms.csv")
    read = load_csv(comms_path, format="compute_comms")
    assert read.orders() == rank_orders("zbv", 2, 4) and read.format == "compute_comms"
    assert ("1RECV_F0" in open(comms_path).read()) and (1, "RECV_F", 0) in [c[:3] for c in read.comms[1]]
    assert csv_schedule(comms_path).format == "compute_comms"  # a schedule path reads either format
    assert _torch_reads(comms_path, 2, 4, 4, format="compute_comms")[0] == actions("zbv", 2, 4)
    with pytest.raises(ValueError, match="column 1 is empty: torch's compute_comms format has no idle cells"):
        parse_csv_text(",0F0\n", format="compute_comms")


def test_an_overlapped_pair_runs_its_actions_one_after_the_other():
    read = parse_csv_text("0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1,0B2\n")
    assert read.orders() == [[(0, "F", 0), (0, "F", 1), (0, "F", 2), (0, "B", 0), (0, "B", 1), (0, "B", 2)]]
    assert read.steps[0][2:4] == (3, 3)


def test_to_csv_text_writes_torchs_notation():
    assert to_csv_text([[(0, "F", 0), (0, "B", 0)], [(1, "F", 0), "1B0"]]) == "0F0,0B0\n1F0,1B0\n"


def test_an_edited_file_is_read_again(tmp_path):
    path = write_csv(rank_orders("1f1b", 2, 2), tmp_path / "edit.csv")
    first = csv_schedule(path)
    assert csv_schedule(path) is first  # read once
    write_csv(rank_orders("1f1b", 2, 4), path)
    os.utime(path, ns=(first_ns := os.stat(path).st_mtime_ns + 10**9, first_ns))
    assert csv_schedule(path).microbatches == 4


# ---- predicting and running ----------------------------------------------------------------------

def _timeline(frame):
    return frame.sort_values(["stage", "microbatch", "phase", "start"])[
        ["stage", "device", "microbatch", "phase", "start", "end"]].reset_index(drop=True)


def test_a_csv_written_from_1f1b_predicts_the_1f1b_timeline(tmp_path):
    table = _table()
    plan = Plan(table, splits=(2, 4, 6), devices=("cpu:0", "cpu:1", "cpu:2", "cpu:3"), chunks=8, schedule="1f1b",
                executor="threads")
    path = _write(tmp_path, plan_code(plan, "schedule-csv"), "1f1b.csv")
    from_file = plan.with_options(schedule=path)
    pd.testing.assert_frame_equal(_timeline(from_file.predict()), _timeline(plan.predict()))
    options = dict(chunks=8, devices=["cpu:0", "cpu:1", "cpu:2", "cpu:3"], executor="threads", per_microbatch=True)
    pd.testing.assert_frame_equal(_timeline(simulate(table, [2, 4, 6], schedule=path, **options)),
                                  _timeline(simulate(table, [2, 4, 6], schedule="1f1b", **options)))


def test_a_csv_written_from_zbv_predicts_the_zbv_timeline_on_its_ranks(tmp_path):
    table = _table()
    table["input_grad_ratio"], table["weight_grad_ratio"] = 0.5, 0.5
    plan = Plan(table, splits=(2, 4, 6), devices=("cpu:a", "cpu:b"), chunks=4, schedule="zbv", executor="threads")
    path = _write(tmp_path, plan_code(plan, "schedule-csv"), "zbv.csv")
    from_file = plan.with_options(schedule=path)
    assert schedules.is_multi_stage(path) and schedules.splits_backward(path)
    pd.testing.assert_frame_equal(_timeline(from_file.predict()), _timeline(plan.predict()))
    assert tl.bubble_by(path) == "device"


def _edited_1f1b(tmp_path):
    """1F1B over two stages and four micro-batches, rank 0 running its third forward before its
    first backward (still a schedule that runs)."""
    orders = rank_orders("1f1b", 2, 4)
    assert orders[0][:4] == [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "F", 2)]
    orders[0][2], orders[0][3] = orders[0][3], orders[0][2]
    return write_csv(orders, tmp_path / "edited.csv"), orders


def test_an_edited_schedule_predicts_its_own_order(tmp_path):
    path, orders = _edited_1f1b(tmp_path)
    plan = Plan(_table(), splits=(4,), devices=("cpu:0", "cpu:1"), chunks=4, schedule=path, executor="threads")
    predicted = plan.predict()
    compute = predicted[predicted["phase"].isin(["forward", "backward"])].sort_values("start")
    ran = [(int(s), "F" if p == "forward" else "B", int(i))
           for s, p, i in zip(compute["stage"], compute["phase"], compute["microbatch"])]
    assert [a for a in ran if a[0] == 0] == orders[0]

    def start(frame, phase, micro):
        at = (frame["stage"] == 0) & (frame["phase"] == phase) & (frame["microbatch"] == micro)
        return float(frame.loc[at, "start"].min())

    unedited = plan.with_options(schedule="1f1b").predict()
    assert start(predicted, "backward", 0) > start(unedited, "backward", 0)  # its forward of 2 first
    assert start(predicted, "forward", 2) < start(unedited, "forward", 2)


def _reference(model, x, target):
    reference = copy.deepcopy(model)
    loss = nn.functional.mse_loss(reference(x), target)
    loss.backward()
    return loss.item(), [p.grad for p in reference.parameters()]


@pytest.mark.parametrize("source", ["zbv", "dualpipev", "edited"])
def test_threads_run_a_csv_with_the_gradients_of_a_plain_step(tmp_path, source):
    torch.manual_seed(0)
    model = plain_model()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    if source == "edited":
        path, _ = _edited_1f1b(tmp_path)
        balance, devices = [4, 4], ["cpu", "cpu"]
    else:
        path = write_csv(rank_orders(source, 2, 4), tmp_path / f"{source}.csv")
        balance, devices = [2, 2, 2, 2], ["cpu", "cpu"]
    loss, grads = _reference(model, x, target)
    executor = ScheduleExecutor(copy.deepcopy(model), balance, devices=devices, chunks=4, schedule=path,
                                checkpoint="except_last", loss_fn=nn.functional.mse_loss)
    assert executor.worker_orders == load_csv(path).orders() and len(executor.worker_devices) == 2
    result = executor.step(x, target)
    assert result.loss == pytest.approx(loss, rel=1e-5)
    for got, expected in zip(executor.parameters(), grads, strict=True):
        torch.testing.assert_close(got.grad, expected)


def test_a_csv_plan_runs_in_the_threads_executor_as_the_plan_predicts(tmp_path):
    from pipexplore.executors.step import run_step
    import pipexplore

    torch.manual_seed(0)
    model = plain_model()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    path = write_csv(rank_orders("zbv", 2, 4), tmp_path / "zbv.csv")
    table = pipexplore.profile(copy.deepcopy(model), x, repeats=1, calibrate=False)
    plan = Plan(table, (2, 4, 6), ("cpu", "cpu"), chunks=4, schedule=path, executor="threads")
    result = run_step(model, x, plan, target=target, loss_fn=nn.functional.mse_loss, warmup=0)
    assert result.loss == pytest.approx(_reference(model, x, target)[0], rel=1e-5)
    measured = result.timeline
    assert {"input_grad", "weight_grad"} <= set(measured["phase"]) and set(measured["stage"]) == {0, 1, 2, 3}


def test_the_explorer_takes_a_csv_schedule_and_exports_it(tmp_path):
    from pipexplore.widgets.state import ExplorerState

    path = write_csv(rank_orders("zbv", 2, 4), tmp_path / "zbv.csv")
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(8)])
    state = ExplorerState(model, torch.randn(8, 6), schedule=path, calibrate=False)
    plan = state.plan  # the file's stages, ranks and micro-batches, where none were given
    assert (plan.num_stages, plan.num_devices, plan.chunks, plan.schedule) == (4, 2, 4, path)
    assert len(plan.predicted) and state.export("schedule-csv") == open(path).read()
    assert "_PipelineScheduleRuntime(stages," in state.export("pipelining")
    script = state.export("torchrun", hooks="my_hooks")
    assert "_load_schedule_csv(schedule, SCHEDULE_CSV, str(SCHEDULE_CSV_FORMAT))" in script
    assert "STAGES_OF_RANK = [[0, 3], [1, 2]]" in script
    compile(script, "train_pipeline.py", "exec")
    assert state.runner.run()["loss"] > 0
    with pytest.raises(ValueError, match="does not fit the plan: expected 2 micro-batches"):
        state.update(chunks=2)
    gpipe = ExplorerState(model, torch.randn(8, 6), devices=["cpu", "cpu"], chunks=2, splits=[4], calibrate=False)
    assert gpipe.export("schedule-csv") == "0F0,0F1,0B1,0B0\n1F0,1F1,1B1,1B0\n"  # what the plan predicts


# ---- processes: torch's runtime loads the file ----------------------------------------------------

@pytest.mark.slow
def test_processes_run_a_csv_through_torchs_runtime_with_the_gradients_of_one_process(tmp_path):
    from pipexplore.executors.distributed import run_processes
    from ranks import plan_for

    torch.manual_seed(0)
    model = plain_model()
    x, target = torch.randn(8, 6), torch.randn(8, 6)
    path, _ = _edited_1f1b(tmp_path)
    plan = plan_for(model, x, [4], ["cpu"] * 2, path)
    result = run_processes(model, x, plan, target=target, loss_fn=nn.functional.mse_loss, return_grads=True, warmup=0)
    reference = copy.deepcopy(model)
    loss = nn.functional.mse_loss(reference(x), target)
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    named = dict(reference.named_parameters())
    assert len(result.metrics["grads"]) == len(named)
    for key, grad in result.metrics["grads"].items():
        torch.testing.assert_close(grad, named[key.split(".", 1)[1]].grad)
    measured = result.timeline
    rank0 = measured[measured["stage"] == 0].sort_values("start")
    assert list(zip(rank0["phase"], rank0["microbatch"])) == [
        ("forward", 0), ("forward", 1), ("forward", 2), ("backward", 0), ("backward", 1), ("forward", 3),
        ("backward", 2), ("backward", 3), ("optimizer", -1)]  # the edited order, as torch ran it


@pytest.mark.slow
def test_a_traced_model_runs_a_csv_in_processes_and_in_its_exported_script(tmp_path):
    import pathlib

    from pipexplore.executors.distributed import run_processes
    from pipexplore.export.torchrun import torchrun_script
    from ranks import assert_equals_unsplit, torchrun_first_loss, traced_tiny_transformer
    from tiny_transformer import loss_fn

    model, tokens, target, table, splits = traced_tiny_transformer()
    path = write_csv(rank_orders("zbv", 2, 4), tmp_path / "zbv.csv")  # a V: stages 1 and 2 share rank 1
    plan = Plan(table, splits, ("cpu",) * 2, chunks=4, schedule=path, executor="processes")
    result = run_processes(model, tokens, plan, target=target, loss_fn=loss_fn, return_grads=True, warmup=0)
    unsplit = assert_equals_unsplit(result, model, tokens, target, loss_fn)

    script = tmp_path / "train_pipeline.py"
    script.write_text(torchrun_script(table, splits, hooks="tiny_transformer", chunks=4, schedule=path, device="cpu"))
    assert torchrun_first_loss(script, str(pathlib.Path(__file__).parent)) == pytest.approx(unsplit, rel=1e-5)


def test_the_pages_schedule_grid_and_the_magic_take_a_csv_schedule(tmp_path):
    from pipexplore.magics import _schedule
    from pipexplore.widgets.schedule_grid import schedule_rows

    path = write_csv(rank_orders("zbv", 2, 4), tmp_path / "zbv.csv")
    plan = Plan(_table(), splits=(2, 4, 6), devices=("cpu", "cpu"), chunks=4, schedule=path, checkpoint="never")
    labels, rows, _ = schedule_rows(plan)
    assert labels == ["rank 0: stages 0, 3", "rank 1: stages 1, 2"] and rows == actions("zbv", 2, 4)
    assert _schedule(path) == path and _schedule("1f1b") == "1f1b"
    with pytest.raises(Exception, match="unknown schedule 'pipedream'.*or give the path of a .csv file"):
        _schedule("pipedream")
