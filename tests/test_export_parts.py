"""The exported torchrun script is the source of real functions (``pipexplore.export.script_parts``
and those it shares with pipexplore), run here as they stand; no Python source is kept in a string;
and every kind of export is named once, in ``pipexplore.export.registry``, which the plan's
export, the explorer and the page read."""
from __future__ import annotations

import ast
import inspect
import pathlib
import re
import socket
import symtable
import sys
import types

import pandas as pd
import pytest
import torch
from torch import nn

from pipexplore.executors import distributed, tied
from pipexplore.export import KINDS, export_kind, mesh_parts, plan_code, script_parts
from pipexplore.export.torchrun import torchrun_script
from pipexplore.models.trace import MULTI_STAGE, SCHEDULE_CLASSES
from pipexplore.models.trace.split import contiguous_boundaries, run_generated_code
from pipexplore.plan import Plan
from pipexplore.schedules import rank_orders, write_csv

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pipexplore"


# ---- no Python source in a string -----------------------------------------------------------------

_FIELD = r"\{[A-Za-z_]\w*(?:![rs])?\}"


def _filled(template: str) -> str:
    """A ``str.format`` template as Python might read once filled: a field on a line of its own (a
    block of code) left out, one that ends an expression empty, any other a name."""
    text = re.sub(rf"^[ \t]*{_FIELD}[ \t]*$", "", template, flags=re.MULTILINE)
    text = re.sub(rf"(?<=[\w\])'\"]){_FIELD}(?!\}})", "", text)
    text = re.sub(rf"(?<!\{{){_FIELD}(?!\}})", "_", text)
    return text.replace("{{", "{").replace("}}", "}")


def _python_strings(source: str, longer_than: int = 40) -> list[tuple[int, int]]:
    """``(line, lines)`` of each string literal of ``source`` past ``longer_than`` lines that parses as
    Python, as it stands or as a ``str.format`` template (its fields filled, its braces undoubled)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        text = node.value
        lines = len(text.splitlines())
        if lines <= longer_than:
            continue
        for candidate in (text, _filled(text)):
            try:
                ast.parse(candidate)
            except SyntaxError:
                continue
            found.append((node.lineno, lines))
            break
    return found


def test_no_python_source_is_kept_in_a_string_literal():
    """Code the package writes out is assembled from real functions (inspect.getsource), which lint,
    mypy and the tests see; a string of more than 40 lines that parses as Python is source hidden."""
    hidden = [f"{path.relative_to(PACKAGE.parent)}:{line} ({lines} lines)"
              for path in sorted(PACKAGE.rglob("*.py")) for line, lines in _python_strings(path.read_text())]
    assert not hidden, "Python source in a string literal: " + ", ".join(hidden)


def test_the_string_scan_sees_source_and_templates_and_leaves_prose():
    body = "".join(f"    x{i} = {i}\n" for i in range(45))
    source = f"A = '''def f():\n{body}'''\n"
    template = ("B = '''def g():\n" + body.replace("x1 = 1", "x1 = {value!r}").replace("x2 = 2", "x2 = [2]{more}")
                + "{block}\n    return {{}}\n'''\n")
    prose = "C = '''" + "a line of prose, not code.\n" * 45 + "'''\n"
    assert [lines for _, lines in _python_strings(source + template + prose)] == [46, 48]


# ---- the script is the source of its parts --------------------------------------------------------

def _table(n: int = 8) -> pd.DataFrame:
    return pd.DataFrame({"name": [f"l{i}" for i in range(n)], "forward": 1.0, "backward": 2.0})


def _scripts(tmp_path) -> dict[str, str]:
    """One script of each shape: pipeline ranks alone, a V, a CSV schedule, and meshes with tp and dp."""
    csv = write_csv(rank_orders("zbv", 2, 4), tmp_path / "zbv.csv")
    return {
        "1f1b": torchrun_script(_table(), [4], hooks="h", chunks=4, schedule="1f1b"),
        "dualpipev": torchrun_script(_table(), [2, 4, 6], hooks="h", chunks=4, schedule="dualpipev"),
        "csv": torchrun_script(_table(), [2, 4, 6], hooks="h", chunks=4, schedule=str(csv)),
        "tp": torchrun_script(_table(), [4], hooks="h", chunks=4, schedule="1f1b", mesh={"pp": 2, "dp": 2, "tp": 2},
                              data_parallel="fsdp", tp_plan={"l*": "colwise"}),
        "zero1": torchrun_script(_table(), [4], hooks="h", chunks=4, schedule="gpipe",
                                 mesh={"pp": 2, "dp": 2, "tp": 1}, data_parallel="zero1"),
    }


def test_the_script_holds_the_source_of_every_function_it_runs(tmp_path):
    shared = [contiguous_boundaries, run_generated_code, mesh_parts.full_state, distributed._no_self_warmup]
    for name, script in _scripts(tmp_path).items():
        compile(script, f"{name}.py", "exec")
        held = [*script_parts.FUNCTIONS, *shared]
        held += list(mesh_parts.SCRIPT_FUNCTIONS) if name in ("tp", "zero1") else []
        held += [distributed._load_schedule_csv] if name == "csv" else []
        for function in held:
            assert inspect.getsource(function) in script, (name, function.__name__)
        assert tied.SOURCE in script
        defined = {node.name for node in ast.parse(script).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        assert defined == {f.__name__ for f in held} | {"tied_parameters", "tied_groups", "sum_tied_grads",
                                                        "own_parameters"}, name
        assignments = {target.id for node in ast.parse(script).body if isinstance(node, ast.Assign)
                       for target in node.targets if isinstance(target, ast.Name)}
        mesh = name in ("tp", "zero1")
        expected = {*script_parts.CONSTANTS, *(script_parts.MESH_CONSTANTS + tuple(mesh_parts.SCRIPT_CONSTANTS)
                                               if mesh else ())}
        assert assignments == expected, name
        assert script.rstrip().endswith('if __name__ == "__main__":\n    main()')


def _imported(script: str) -> set[str]:
    """The modules the script imports, at its top or in its functions."""
    names = set()
    for node in ast.walk(ast.parse(script)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def test_the_script_imports_torch_and_the_standard_library_only(tmp_path):
    """No pipexplore on the cluster, but for --record's recorder."""
    for name, script in _scripts(tmp_path).items():
        ours = {module for module in _imported(script) if module.split(".")[0] == "pipexplore"}
        assert ours == {"pipexplore.runs.record"}, name
        others = {module.split(".")[0] for module in _imported(script)} - {"pipexplore", "torch", "__future__"}
        assert others <= set(sys.stdlib_module_names), (name, others)


def _globals_read(scope: symtable.SymbolTable) -> set[str]:
    """The global names a function (its inner functions too) reads."""
    names = {s.get_name() for s in scope.get_symbols() if s.is_global() and s.is_referenced()}
    return names.union(*(_globals_read(child) for child in scope.get_children()))


def test_every_name_the_scripts_functions_read_is_defined_in_it(tmp_path):
    """A function's global names resolve in the script (a script without a mesh leaves the mesh's
    functions and constants out: ``main`` reaches them only where MESH is set; one without a schedule
    file its loader, reached only where SCHEDULE_CSV is set)."""
    import builtins

    mesh_only = {f.__name__ for f in mesh_parts.SCRIPT_FUNCTIONS}
    for name, script in _scripts(tmp_path).items():
        table = symtable.symtable(script, f"{name}.py", "exec")
        defined = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
        defined |= {c.get_name() for c in table.get_children()} | set(dir(builtins)) | {"__doc__", "__name__"}
        missing = set().union(*(_globals_read(child) for child in table.get_children())) - defined
        allowed = set() if name in ("tp", "zero1") else mesh_only | set(script_parts.MESH_CONSTANTS)
        allowed |= set() if name == "csv" else {"_load_schedule_csv"}
        assert missing <= allowed, (name, missing - allowed)


def test_the_csv_schedule_loader_is_the_executors_own(tmp_path):
    """One loader: the script's is the source of the function the processes executor calls."""
    script = _scripts(tmp_path)["csv"]
    assert script.count("._load_csv(") == 1
    assert "_load_schedule_csv(schedule, SCHEDULE_CSV, str(SCHEDULE_CSV_FORMAT))" in script
    callers = [path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
               if re.search(r"^\s*[a-z_.]*\._load_csv\(", path.read_text(), re.MULTILINE)]
    assert callers == ["executors/distributed.py"]


def test_a_schedule_runs_a_list_of_stages_where_torch_says_it_takes_several():
    from torch.distributed.pipelining import schedules

    for name in [*SCHEDULE_CLASSES.values(), "_PipelineScheduleRuntime"]:
        assert issubclass(getattr(schedules, name), schedules.PipelineScheduleMulti) == (name in MULTI_STAGE), name


# ---- the parts, run here -------------------------------------------------------------------------------

def test_each_rank_runs_the_stages_of_its_layout(monkeypatch):
    monkeypatch.setattr(script_parts, "SPLIT_POINTS", ["l2", "l4", "l6"])
    assert [script_parts.stages_of(r, 4) for r in range(4)] == [[0], [1], [2], [3]]
    assert [script_parts.stages_of(r, 2) for r in range(2)] == [[0, 2], [1, 3]]  # looped
    monkeypatch.setattr(script_parts, "V_SHAPED", True)
    assert [script_parts.stages_of(r, 2) for r in range(2)] == [[0, 3], [1, 2]]
    monkeypatch.setattr(script_parts, "STAGES_OF_RANK", [[0, 1], [2, 3]])  # a schedule file's
    assert [script_parts.stages_of(r, 2) for r in range(2)] == [[0, 1], [2, 3]]


def test_the_small_parts_as_the_script_runs_them():
    x = torch.randn(2, 3)
    assert script_parts.call_inputs(x) == ((x,), {}) and script_parts.call_inputs({"a": x}) == ((), {"a": x})
    assert script_parts.call_inputs([x, x])[0] == (x, x)
    assert script_parts.model_output((x,), None) is x and script_parts.model_output([x, x], None) == (x, x)
    optimizer = script_parts.default_optimizer([nn.Parameter(torch.zeros(1))])
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["lr"] == 0.01
    assert script_parts.rank_device("cpu", 0) == torch.device("cpu")
    options = script_parts.parse_options(["--steps", "3", "--device", "cpu"])
    assert (options.steps, options.device, options.record, options.warmup) == (3, "cpu", None, None)
    model = nn.Linear(2, 2)
    model.config = types.SimpleNamespace(use_cache=True)
    assert script_parts.without_kv_cache(model) is model and model.config.use_cache is False
    assert not script_parts.on_meta(model)
    assert script_parts.replica_batch(lambda: 1, 0, 1) == 1
    assert script_parts.replica_batch(lambda replica, replicas: (replica, replicas), 1, 2) == (1, 2)


HOOKS = '''
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))


def get_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 6, generator=generator)


def loss_fn(output, target):
    return ((output - target) ** 2).mean()
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch's pipeline() copying its own specs
def test_main_trains_a_one_stage_plan_on_one_rank_here(tmp_path, monkeypatch, capsys):
    """The script's main(), as it stands in its module: one rank, one stage, gloo; its loss the model's."""
    (tmp_path / "parts_hooks.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(script_parts, "HOOKS", "parts_hooks")
    monkeypatch.setattr(script_parts, "CHUNKS", 2)
    monkeypatch.setattr(script_parts, "CHECKPOINT", "always")
    import parts_hooks

    inputs, target = parts_hooks.get_batch()
    expected = parts_hooks.loss_fn(parts_hooks.build_model()(inputs), target).item()
    script_parts.main(["--device", "cpu", "--steps", "2", "--save", str(tmp_path / "saved")])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in printed] == ["0", "1"]
    assert float(printed[0].split("loss=")[1].split()[0]) == pytest.approx(expected, rel=1e-5)
    saved = torch.load(tmp_path / "saved" / "stage0.pt")
    assert sorted(saved) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert not torch.equal(saved["0.weight"], parts_hooks.build_model()[0].weight)  # trained two steps
    sys.modules.pop("parts_hooks", None)


# ---- one registry of kinds ---------------------------------------------------------------------------

NAMES = ["gpipe", "pipelining", "torchrun", "schedule-csv", "megatron", "torchtitan", "chrome-trace", "html"]


def test_the_registry_names_each_kind_once():
    assert list(KINDS) == NAMES and [kind.name for kind in KINDS.values()] == NAMES
    labels = [kind.label for kind in KINDS.values()]
    assert len(set(labels)) == len(labels)
    assert all(kind.suffix.startswith(".") and callable(kind.write) for kind in KINDS.values())
    with pytest.raises(ValueError, match=r"unknown export kind 'deepspeed': 'gpipe', .* 'chrome-trace' or 'html'"):
        export_kind("deepspeed")


def test_a_plan_exports_as_every_kind_of_the_registry():
    plan = Plan(_table(4), splits=(2,), devices=("cpu", "cpu"), chunks=2)
    written = {}
    for name in NAMES:
        if name in ("megatron", "torchtitan"):  # a plain table is no model either of them builds
            continue
        if name == "html":
            with pytest.raises(ValueError, match="the HTML report is the explorer's page"):
                plan_code(plan, name)
            written[name] = plan_code(plan, name, report=lambda: "<html></html>")
            continue
        written[name] = plan_code(plan, name, hooks="h")
    assert written["gpipe"].startswith("from pipexplore import GPipe") and "SCHEDULE_CLASS" in written["torchrun"]
    assert written["schedule-csv"].startswith("0F0,") and '"traceEvents"' in written["chrome-trace"]
    with pytest.raises(ValueError, match="unknown export kind 'pdf'"):
        plan_code(plan, "pdf")


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_the_page_and_the_explorer_take_exactly_the_registrys_kinds():
    from pipexplore import explore

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    ex = explore(model, torch.randn(8, 4), chunks=2, devices=["cpu", "cpu"], calibrate=False, profile_repeats=1)
    assert [value for _, value in ex.w_export_kind.options] == NAMES
    assert [label for label, _ in ex.w_export_kind.options] == [kind.label for kind in KINDS.values()]
    for name in NAMES:
        if name in ("megatron", "torchtitan"):
            continue
        assert ex.export(name)
    assert ex.export("html").lstrip().lower().startswith("<!doctype html") or "<html" in ex.export("html")[:200]
    with pytest.raises(ValueError, match=r"unknown export kind 'pdf': 'gpipe', 'pipelining', .* or 'html'"):
        ex.export("pdf")
    ex.w_export_kind.value = "torchrun"
    ex.w_export.click()
    assert ex.w_code.code == ex.export("torchrun")
    assert ex.w_code.title == KINDS["torchrun"].title.format(ranks=2, shown="")
