"""``import pipexplore`` imports its public names on first use (PEP 562): a process that needs one
module (a torchrun rank importing ``pipexplore.runs.record``) imports that module, not the library;
every name of ``__all__`` still resolves, by attribute and by ``from pipexplore import``."""
from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import pipexplore

INIT = pathlib.Path(pipexplore.__file__)


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(out.stdout.splitlines()[-1]))


@pytest.fixture(scope="module")
def rank_then_all_names() -> tuple[set[str], set[str]]:
    """One fresh interpreter (torch's import paid once): the modules after a rank's import of the
    recorder, then after every public name was resolved, by attribute and by ``from pipexplore import``
    (but the explorer's two, whose widget library costs ~2 s of CPU more: resolved in this process)."""
    code = ("import json, sys\n"
            "import pipexplore.runs.record\n"
            "print(json.dumps(sorted(sys.modules)))\n"
            "import pipexplore\n"
            "for name in set(pipexplore.__all__) - {'explore', 'Explorer'}:\n"
            "    assert getattr(pipexplore, name) is not None, name\n"
            "    exec(f'from pipexplore import {name}')\n"
            "assert set(pipexplore.__all__) <= set(dir(pipexplore)), dir(pipexplore)\n"
            "print(json.dumps(sorted(sys.modules)))\n"
            "import pipexplore.widgets.state\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rank, everything, state = out.stdout.splitlines()[-3:]
    return set(json.loads(rank)), set(json.loads(everything)), set(json.loads(state))


def test_a_rank_importing_the_recorder_imports_nothing_else_of_the_package(rank_then_all_names):
    modules = rank_then_all_names[0]
    assert {m for m in modules if m.startswith("pipexplore")} == {"pipexplore", "pipexplore.runs",
                                                                   "pipexplore.runs.record"}
    assert not {"pandas", "ipywidgets", "IPython", "pipexplore.widgets", "pipexplore.gpipe"} & modules


def test_every_public_name_resolves(rank_then_all_names):
    assert {"pipexplore.gpipe", "pipexplore.predict.simulator"} <= rank_then_all_names[1]
    assert "pipexplore.widgets" not in rank_then_all_names[1]  # the library's names need no widget
    for name in pipexplore.__all__:
        exec(f"from pipexplore import {name}", {})
        assert getattr(pipexplore, name) is not None, name


def test_the_library_and_the_explorers_state_leave_torchs_pipelining_until_a_script_is_written(rank_then_all_names):
    """torch's pipelining (with dynamo, export and DTensor: ~1.4 s of a fresh interpreter's import)
    is imported by what runs it — a rank, a traced split, a script's export — not by planning or by
    the explorer's state."""
    everything, state = rank_then_all_names[1:]
    assert {"pipexplore.export.torchrun", "pipexplore.widgets.state"} <= state
    assert not {"torch.distributed.pipelining", "pipexplore.export.script_parts"} & (everything | state)


def test_importing_the_package_imports_no_module_of_it_nor_torch():
    modules = _modules_after("import pipexplore")
    assert {m for m in modules if m.startswith("pipexplore")} == {"pipexplore"}
    assert "torch" not in modules


def test_the_public_names_are_the_objects_of_their_modules():
    from pipexplore.gpipe import GPipe
    from pipexplore.timeline.recorder import record
    from pipexplore.widgets.explorer import explore

    assert pipexplore.GPipe is GPipe and pipexplore.record is record and pipexplore.explore is explore
    assert pipexplore.balance is sys.modules["pipexplore.balance"]
    assert pipexplore.timeline is sys.modules["pipexplore.timeline"]
    assert set(pipexplore.__all__) <= set(dir(pipexplore))


def test_the_lazy_map_and_the_type_checkers_imports_name_the_same_things():
    """Every name of ``__all__`` is defined in ``__init__`` or imported lazily, each lazy name from
    the module that the ``if TYPE_CHECKING:`` imports give type checkers."""
    tree = ast.parse(INIT.read_text())
    checking = next(node for node in tree.body
                    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    typed = {}
    for node in checking.body:
        assert isinstance(node, ast.ImportFrom)
        for alias in node.names:
            typed[alias.name] = f"{node.module}.{alias.name}" if node.module == "pipexplore" else node.module
    assert typed == pipexplore._LAZY
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)} | {"__version__"}
    assert set(pipexplore.__all__) == set(typed) | (defined & set(pipexplore.__all__))


def test_subpackages_still_resolve_and_unknown_names_do_not():
    assert pipexplore.schedules is sys.modules["pipexplore.schedules"]  # as `import pipexplore` left it bound
    try:
        pipexplore.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("an unknown name resolved")
    assert not hasattr(pipexplore, "_private")
