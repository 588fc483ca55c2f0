"""The training parts (``pipexplore.training``): the loss, optimizer and target resolved once where
they enter, the synthetic loss every step trains on without a ``loss_fn`` — the executors, the
traced model's block timing, the meta-device count — and the defaults written nowhere else."""
from __future__ import annotations

import ast
import copy
import dataclasses
import pathlib
import re

import pytest
import torch
from torch import nn

from pipexplore import training
from pipexplore.executors.base import StepJob
from pipexplore.executors.step import run_step
from pipexplore.models import meta, trace
from pipexplore.plan import Plan
from pipexplore.training import Training, default_optimizer, synthetic_loss
from pipexplore.widgets.state import ExplorerState

from models import plain_model
from ranks import no_pool_left_behind  # noqa: F401  (every pool gone after the module)

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pipexplore"


class Blocks(nn.Module):
    """Two blocks, not an ``nn.Sequential`` (so the traced and meta paths take it)."""

    def __init__(self, integer_output: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.integer_output = integer_output

    def forward(self, x: torch.Tensor):
        for layer in self.layers:
            x = layer(x)
        return x.argmax(-1) if self.integer_output else {"hidden": x, "pair": (x * 2, torch.arange(3))}


# ---- the synthetic loss ---------------------------------------------------------------------------
def test_every_floating_tensor_counts_however_nested_and_integers_do_not():
    a, b = torch.ones(2, 2), torch.full((3,), 2.0, dtype=torch.float16)
    loss = synthetic_loss({"a": a, "rest": [b, (torch.arange(4),)]})
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(1.0 + 4.0)
    assert StepJob(nn.Linear(1, 1), torch.ones(1, 1), None).training.loss_fn is synthetic_loss  # type: ignore[arg-type]


def test_an_output_with_nothing_floating_is_named():
    with pytest.raises(TypeError, match=r"needs a floating tensor in the model's output, got dict: pass loss_fn="):
        synthetic_loss({"ids": torch.arange(3)})


def test_the_traced_block_timing_trains_on_the_same_loss():
    """The blocks timed inside whole passes get their backward from the same loss as a run: the
    gradient of the first block's weight equals that of synthetic_loss on the model's output."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(8, 4)
    seen = {}

    def keep(weight: torch.Tensor) -> None:
        seen["grad"] = weight.grad.clone()

    model.layers[0].weight.register_post_accumulate_grad_hook(keep)
    table = trace.candidates(model, x, repeats=1, warmup=0, time_optimizer=False)
    assert list(table["name"]) == ["layers.0", "layers.1"] and (table["backward"] > 0).all()
    reference = Blocks()
    reference.load_state_dict(model.state_dict())
    synthetic_loss(reference(x)).backward()
    torch.testing.assert_close(seen["grad"], reference.layers[0].weight.grad)


def test_the_traced_block_timing_names_an_output_it_cannot_differentiate():
    """Before, the sum of nothing (0) was differentiated: "'int' object has no attribute 'backward'"."""
    with pytest.raises(TypeError, match=r"needs a floating tensor in the model's output, got Tensor"):
        trace.candidates(Blocks(integer_output=True), torch.randn(8, 4), repeats=1, warmup=0, time_optimizer=False)


def test_the_meta_count_takes_an_integer_output_as_a_forward_alone():
    """Counting on the meta device needs no loss to go on: an output with nothing to differentiate
    is counted as a floating one is (the backward by its formulas), where a run refuses it."""
    with torch.device("meta"):
        integer, floating = Blocks(integer_output=True), Blocks()
    x = torch.empty(8, 4, device="meta")
    counted, both = meta.count_layers(integer, x), meta.count_layers(floating, x)
    assert list(counted["forward_flops"]) == list(both["forward_flops"]) == [2 * 8 * 4 * 4] * 2
    assert list(counted["backward_flops"]) == list(both["backward_flops"]) == [2 * 2 * 8 * 4 * 4] * 2


# ---- Training.of ----------------------------------------------------------------------------------
def test_training_of_resolves_the_defaults_and_keeps_what_is_given():
    default = Training.of()
    assert default.loss_fn is synthetic_loss and default.optimizer is default_optimizer and default.target is None
    assert not default.given_loss
    assert isinstance(default.optimizer([nn.Parameter(torch.zeros(2))]), torch.optim.SGD)
    assert default_optimizer.func is torch.optim.SGD and default_optimizer.keywords == {"lr": 0.01}  # type: ignore

    def make_adam(params):
        return torch.optim.Adam(params)

    target = torch.zeros(4, 1)
    given = Training.of(nn.functional.mse_loss, make_adam, target, rows=4)
    assert (given.loss_fn, given.optimizer, given.target) == (nn.functional.mse_loss, make_adam, target)
    assert given.given_loss and given.schedule_target(4) is target
    assert given.keywords() == {"loss_fn": nn.functional.mse_loss, "optimizer": make_adam, "target": target}
    # a Training's parts give it back as it was (an entry handed resolved parts resolves nothing new)
    again = Training.of(**default.keywords())
    assert (again.loss_fn, again.optimizer, again.target, again.given_loss) == (synthetic_loss, default_optimizer,
                                                                                None, False)
    assert default.schedule_target(3).shape == (3, 1) and not default.schedule_target(3).any()
    with pytest.raises(dataclasses.FrozenInstanceError):  # read, never completed
        default.loss_fn = nn.functional.mse_loss  # type: ignore[misc]


def test_training_of_names_what_is_wrong_where_it_enters():
    with pytest.raises(TypeError, match=r"loss_fn must be a callable loss_fn\(output, target\) or None, got 3"):
        Training.of(loss_fn=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"optimizer must be a callable optimizer\(parameters\)"):
        Training.of(optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"target has 3 rows but the sample has 4"):
        Training.of(target=torch.zeros(3), rows=4)


# ---- every entry, one loss ------------------------------------------------------------------------
@pytest.fixture
def synthetic_calls(monkeypatch):
    """Every call of :func:`pipexplore.training.synthetic_loss` in this process, counted through
    the one module-level name it reads (no other function of the module reads it)."""
    calls: list[int] = []
    real = training.tensors_in

    def counted(value):
        calls.append(1)
        return real(value)

    monkeypatch.setattr(training, "tensors_in", counted)
    return calls


def _sequential_plan(model: nn.Sequential, executor: str, schedule: str = "1f1b") -> Plan:
    import pandas as pd

    table = pd.DataFrame({"name": [str(k) for k in range(len(model))], "forward": 1e-4, "backward": 2e-4,
                          "output_bytes": 100.0, "param_bytes": 100.0})
    return Plan(table, (4,), ("cpu", "cpu"), chunks=2, schedule=schedule, executor=executor)


@pytest.mark.parametrize("executor, schedule", [("threads", "1f1b"), ("autograd", "gpipe"),
                                                ("processes", "gpipe"), ("threads", "async-backends")])
def test_every_executor_without_a_loss_fn_trains_on_the_synthetic_loss(synthetic_calls, executor, schedule):
    """The loss each executor reports at the model's weights is the synthetic loss of the unsplit
    model (the processes' ranks get it by value from the one Training; the backends' first step
    already sees updates, so only their calls are counted)."""
    torch.manual_seed(0)
    model, x = plain_model(), torch.randn(8, 6)
    result = run_step(model, x, _sequential_plan(model, executor, schedule), warmup=0, repeats=1)
    if executor != "processes":  # (the ranks' calls are theirs)
        assert synthetic_calls
    if schedule != "async-backends":
        with torch.no_grad():
            assert result.loss == pytest.approx(synthetic_loss(copy.deepcopy(model)(x)).item(), rel=1e-5)


def test_the_traced_executor_and_every_profile_of_a_model_time_the_same_loss(synthetic_calls):
    """A model that is not an nn.Sequential: its run (traced stages in threads), its block timing,
    its meta count and the explorer's profile of it all call the one synthetic loss, and the run's
    loss is that of the unsplit model."""
    torch.manual_seed(0)
    model, x = Blocks(), torch.randn(8, 4)
    table = trace.candidates(copy.deepcopy(model), x, repeats=1, warmup=0)
    assert synthetic_calls
    synthetic_calls.clear()
    plan = Plan(table, (1,), ("cpu", "cpu"), chunks=2, schedule="1f1b", executor="threads")
    result = run_step(model, x, plan, warmup=0, repeats=1)
    assert synthetic_calls
    with torch.no_grad():
        assert result.loss == pytest.approx(synthetic_loss(copy.deepcopy(model)(x)).item(), rel=1e-5)
    synthetic_calls.clear()
    with torch.device("meta"):
        on_meta = Blocks()
    meta.count_layers(on_meta, torch.empty(8, 4, device="meta"))
    assert synthetic_calls
    synthetic_calls.clear()
    state = ExplorerState(model, x, chunks=2, profile_repeats=1, profile_stages=False, calibrate=False)
    assert synthetic_calls and state.training.loss_fn is synthetic_loss and not state.training.given_loss
    assert any(note.startswith("No loss_fn given") for note in state.notes)


def test_the_explorer_resolves_once_and_keeps_the_users_parts():
    """What the user gives reaches the state's one Training as given; the page says nothing of a
    synthetic loss then."""
    model, x, y = plain_model(), torch.randn(8, 6), torch.randn(8, 6)

    def make_adam(params):
        return torch.optim.Adam(params)

    state = ExplorerState(model, x, target=y, loss_fn=nn.functional.mse_loss, optimizer=make_adam, chunks=2,
                          profile_repeats=1, calibrate=False)
    assert state.training.loss_fn is nn.functional.mse_loss and state.training.optimizer is make_adam
    assert state.training.target is y and state.training.given_loss
    assert not any(note.startswith("No loss_fn given") for note in state.notes)
    with pytest.raises(ValueError, match=r"target has 7 rows but the sample has 8"):
        ExplorerState(model, x, target=torch.zeros(7, 6))  # (refused before anything is profiled)


# ---- the defaults, written once -------------------------------------------------------------------
#: Where the package may name a default or make an SGD outside training.py, and why: each a choice
#: the user names, or the exported script's own (it imports no pipexplore), not a second default.
ALLOWED = {
    ("predict/planned_optimizer.py", "default_optimizer"):
        "OPTIMIZERS['sgd']: the name a user gives for the runs' default, which it reads",
    ("predict/planned_optimizer.py", "SGD(lr=0.01, momentum=0.9)"):
        "OPTIMIZERS['momentum']: a choice the user names, not a default",
    ("export/script_parts.py", "default_optimizer"):
        "the exported script's default: the script imports no pipexplore (to be written from default_optimizer)",
    ("export/script_parts.py", "SGD(lr=0.01)"):
        "the exported script's default: the script imports no pipexplore (to be written from default_optimizer)",
}
DEFAULTS = {"synthetic_loss", "default_optimizer"}


def _named(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _defaults_named(tree: ast.AST) -> list[tuple[int, str]]:
    """Where code (not a string: docstrings and their examples are left alone) names a default or
    an SGD: ``(line, what)``, an SGD made with its keywords (``SGD(lr=0.01)``)."""
    calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    found = []
    for node in ast.walk(tree):
        name = _named(node)
        if name in DEFAULTS:
            found.append((node.lineno, name))  # type: ignore[attr-defined]
        elif name == "SGD":
            call = calls.get(id(node))
            keywords = ", ".join(f"{k.arg}={ast.unparse(k.value)}" for k in call.keywords) if call else ""
            found.append((node.lineno, f"SGD({keywords})" if call else "SGD"))  # type: ignore[attr-defined]
    return sorted(found)


def test_the_defaults_are_written_only_in_training_py():
    """`loss_fn or synthetic_loss`, `optimizer or default_optimizer`, `SGD(params, lr=0.01)`: none
    of them outside pipexplore/training.py. Everything else reads a Training (or makes one with
    Training.of where the user's None enters)."""
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "training.py":
            continue
        for line, what in _defaults_named(ast.parse(path.read_text())):
            if (where, what) not in ALLOWED:
                wrong.append(f"{where}:{line} {what}")
    assert not wrong, "a default of its own (read pipexplore.training.Training instead): " + ", ".join(wrong)


def test_the_loss_and_optimizer_types_are_spelled_once():
    """``LossFn`` and ``OptimizerFactory`` (pipexplore.training) are the types of a loss and an
    optimizer factory; no annotation spells them out again."""
    spelled = re.compile(r"Callable\[\[[^\]]*\], (torch\.)?(Tensor|optim\.Optimizer)\]")
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "training.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            annotations = ([node.annotation] if isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation
                           else [node.returns] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and node.returns else [])
            wrong += [f"{where}:{a.lineno} {ast.unparse(a)}" for a in annotations if spelled.search(ast.unparse(a))]
    assert not wrong, "spell these LossFn or OptimizerFactory (pipexplore.training): " + ", ".join(wrong)


def test_the_static_checks_see_a_default_of_its_own():
    """The checks are not vacuous: a reader's own fallback and its own SGD are found."""
    tree = ast.parse("def step(loss_fn=None, optimizer=None):\n"
                     "    loss_fn = loss_fn or synthetic_loss\n"
                     "    make = optimizer or (lambda p: torch.optim.SGD(p, lr=0.01))\n")
    assert _defaults_named(tree) == [(2, "synthetic_loss"), (3, "SGD(lr=0.01)")]
    assert _defaults_named(ast.parse('"""Example: torch.optim.SGD(p, lr=0.1), loss_fn or synthetic_loss"""')) == []
