"""One meaning per name: no public function or class name is defined in two modules of the package
(one concept, one definition, imported where needed; two concepts, two names)."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "pipexplore"

#: Names defined in several modules on purpose: each a protocol a caller reaches by the module, not
#: one concept written twice.
PROTOCOLS = {
    "run",  # an executor module's entry point: pipexplore.executors.backends picks the module, then calls run
    "main",  # a process's entry point (the worker process, the exported script)
    "load_ipython_extension", "unload_ipython_extension",  # IPython's hooks, for the package and for magics
}

#: Names the exported torchrun script's own functions (``export/script_parts.py``, whose source the
#: script holds) still define beside the package's one: to become imports of that one, as the script's
#: other shared functions are. Each entry must still be a duplicate (the list only shrinks).
SCRIPT_COPIES = {"call_inputs", "model_output", "on_meta", "without_kv_cache"}

#: Names torchgpipe's modules define, kept under torchgpipe's name in the modules that mirror them
#: (``pipeline.wait``, ``worker.Task``, ``microbatch.check``, ``checkpoint.checkpoint``), beside a
#: pipexplore module of the same name for another concept: to rename on pipexplore's side.
TO_RENAME = {"wait", "Task", "checkpoint", "blocks_of"}


def _definitions() -> dict[str, list[str]]:
    """Every public top-level function and class name, with the modules defining it."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                found.setdefault(node.name, []).append(str(path.relative_to(PACKAGE.parent)))
    return found


def test_no_public_name_is_defined_in_two_modules():
    twice = {name: where for name, where in _definitions().items()
             if len(where) > 1 and name not in PROTOCOLS | TO_RENAME
             and not (name in SCRIPT_COPIES and "pipexplore/export/script_parts.py" in where)}
    assert not twice, f"one name, several definitions (import the one, or name each for what it is): {twice}"


def test_the_exceptions_are_still_needed():
    """An exception that no longer names a duplicate goes: the lists only shrink."""
    definitions = _definitions()
    stale = sorted(name for name in PROTOCOLS | SCRIPT_COPIES | TO_RENAME if len(definitions.get(name, [])) < 2)
    assert not stale, f"no longer defined twice, take them off the lists: {stale}"


def test_the_check_sees_a_second_definition(tmp_path, monkeypatch):
    package = tmp_path / "pipexplore"
    (package / "a").mkdir(parents=True)
    (package / "a" / "one.py").write_text("def tensor_bytes(x):\n    return 0\n\nclass _Private:\n    pass\n")
    (package / "two.py").write_text("from pipexplore.a.one import tensor_bytes\n\ndef tensor_bytes(x):\n    return 1\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", package)
    assert _definitions() == {"tensor_bytes": ["pipexplore/a/one.py", "pipexplore/two.py"]}


def test_each_concept_has_one_definition_or_its_own_name():
    definitions = _definitions()
    for name, module in [("tensor_bytes", "pipexplore/timeline/saved.py"), ("SavedBytes", "pipexplore/timeline/saved.py"),
                         ("SavedStorageBytes", "pipexplore/models/opcount.py"), ("to_meta", "pipexplore/models/opcount.py"),
                         ("balanced_splits", "pipexplore/widgets/layer_table.py"),
                         ("plan_balanced_splits", "pipexplore/predict/sweep.py"),
                         ("shared_parameters", "pipexplore/splits.py"),
                         ("stage_shared_parameters", "pipexplore/executors/tied.py")]:
        assert definitions[name] == [module], (name, definitions[name])
    assert "pipexplore/models/profile.py" in definitions["on_meta"]  # a question: is the model on meta?


def test_the_default_optimizer_is_bound_once_in_the_package():
    """``pipexplore.training.default_optimizer`` (a value, not a def): no other module binds the
    name but the exported script's own functions (export/script_parts.py, whose source it holds)."""
    binding = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
            named = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
                [t.id for t in targets if isinstance(t, ast.Name)]
            if "default_optimizer" in named:
                binding[str(path.relative_to(PACKAGE.parent))] = type(node).__name__
    assert binding.pop("pipexplore/training.py") == "AnnAssign"
    assert set(binding) <= {"pipexplore/export/script_parts.py"}, binding
