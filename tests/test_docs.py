"""The tour stays whole: every notebook is listed in the README and run by the README's test command."""
from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block, "README opens with a bash block of the two commands"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2, f"README opens with exactly two commands, found {commands}"
    return commands[1]


def test_every_notebook_is_listed_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) >= 5
    for name in notebooks:
        assert f"(notebooks/{name})" in readme, f"{name} is not linked from README.md"


def test_the_test_command_runs_every_notebook_under_nbval():
    command = _test_command()
    assert command == "make test"
    recipe = re.search(r"^test:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "scripts/test.sh" in recipe
    script = (ROOT / "scripts" / "test.sh").read_text()
    runs = [line for line in script.splitlines() if '"${PYTEST[@]}"' in line]
    # every test runs: the parallel part takes tests/ and notebooks/ but the timing tests, which run after it
    assert len(runs) == 2 and '-m "not timing" tests notebooks --nbval-lax' in runs[0] and "-m timing" in runs[1]
    # ... from every file that marks one
    marked = sorted(p.name for p in (ROOT / "tests").glob("test_*.py")
                    if re.search(r"mark\.timing|^@timing", p.read_text(), re.M))
    files = subprocess.run(["bash", "-c", 'grep -lE "mark\\.timing|^@timing" tests/test_*.py'], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    assert sorted(pathlib.Path(f).name for f in files) == marked and "test_costs.py" in marked
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


def test_binder_installs_the_package_with_cpu_torch():
    requirements = (ROOT / "binder" / "requirements.txt").read_text().splitlines()
    assert "-e ." in requirements and "torch==2.13.0" in requirements


def test_declared_test_dependencies_are_imported_not_skipped():
    """A test extra the project declares is there in CI: a test that would skip without it would hide
    a broken environment (``pytest.importorskip`` is for what the extra does not promise)."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    declared = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("-", "_")
                for requirement in extra}
    assert {"transformers", "playwright", "hypothesis"} <= declared
    skipped = [f"{path.relative_to(ROOT)}: {name}"
               for path in sorted((ROOT / "tests").rglob("*.py"))
               for name in re.findall(r"importorskip\(\s*['\"]([\w.]+)['\"]", path.read_text())
               if name.split(".")[0].lower() in declared]
    assert skipped == [], f"declared test dependencies skipped instead of imported: {skipped}"


def _documented_explorer_names() -> dict[str, list[str]]:
    """Every ``ex.NAME`` the README, docs/ and the notebooks' code show, with where it is shown."""
    import json

    texts = {path: path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        texts[path] = "\n".join("".join(cell["source"]) for cell in cells)
    names: dict[str, list[str]] = {}
    for path, text in texts.items():
        for name in re.findall(r"(?<![\w.])ex\.([A-Za-z_]\w*)", text):
            names.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return names


def test_every_explorer_name_the_docs_show_exists_on_explorer():
    from pipexplore.widgets.explorer import PANEL_OF, Explorer

    names = _documented_explorer_names()
    assert {"run", "export", "set_mesh", "search", "runs"} <= set(names)  # the docs are read
    declared = {name for cls in Explorer.__mro__ for name in vars(cls).get("__annotations__", {})}  # its state's too
    missing = {name: sorted(set(where)) for name, where in names.items()
               if not hasattr(Explorer, name) and name not in declared and name not in PANEL_OF}
    assert not missing, f"the docs show explorer names Explorer does not have: {missing}"


def test_the_lock_pins_every_requirement_within_its_range():
    """``requirements/test.lock`` (what ``make test`` installs) holds an exact version of every
    requirement of the package and its test extra, inside the range ``pyproject.toml`` gives, and
    torch as the CPU wheel's pin."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lock = {}
    for line in (ROOT / "requirements" / "test.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            lock[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in lock, f"{requirement.name} is not in the lock"
        assert requirement.specifier.contains(lock[name], prereleases=True), (text, lock[name])
    assert lock["torch"] == "2.13.0" and "torchtitan" in lock
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '--no-deps -r "$LOCK"' in setup and "LOCK=requirements/test.lock" in (ROOT / "scripts" / "pins.sh").read_text()


def test_notebooks_are_saved_stripped_and_small(tmp_path):
    """A notebook is saved as ``scripts/strip_notebook.py`` leaves it (outputs only where nbval
    checks them, no saved widget state or execution times), so a diff shows its code, ≤ 150 KB."""
    import shutil
    import sys

    paths = sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        assert path.stat().st_size <= 150 * 1024, f"{path.name}: {path.stat().st_size} bytes"
        shutil.copy(path, tmp_path / path.name)
    # one run of the script strips every copy, as its usage line runs it (an interpreter importing
    # nbformat: ~1.5 s of CPU a start)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "strip_notebook.py"),
                    *(str(tmp_path / path.name) for path in paths)], check=True)
    for path in paths:
        copy = tmp_path / path.name
        assert copy.read_text() == path.read_text(), f"{path.name} is not saved stripped: scripts/strip_notebook.py"


def test_the_benchmarks_index_lists_every_script_and_its_links_resolve():
    """``benchmarks/README.md`` opens with an index: a row for every ``benchmarks/*.py`` script (the
    helpers in ``common.py`` included, said to be no benchmark), and every link in it leads to a file
    that exists and, where it names an anchor, to a heading there as GitHub makes its anchors."""
    import unicodedata

    def anchors(path: pathlib.Path) -> set[str]:
        found: set[str] = set()
        fenced = False
        for line in path.read_text().splitlines():
            if line.startswith("```"):
                fenced = not fenced
            heading = re.match(r"#{1,6} (.*)", line)
            if fenced or not heading:
                continue
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1).strip()).lower()
            slug = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN"
                           or unicodedata.category(c) == "Pc").replace(" ", "-")
            candidate, n = slug, 0
            while candidate in found:
                n += 1
                candidate = f"{slug}-{n}"
            found.add(candidate)
        return found

    readme = ROOT / "benchmarks" / "README.md"
    index = readme.read_text().split("\n## ", 1)[0]
    rows = [line for line in index.splitlines() if line.startswith("| ") and not line.startswith("| script ")]
    listed = {m.group(1) for row in rows if (m := re.match(r"\| \[?`([\w.]+\.py)`", row))}
    scripts = {path.name for path in (ROOT / "benchmarks").glob("*.py")}
    assert not scripts - listed, f"benchmarks/README.md's index has no row for {sorted(scripts - listed)}"
    sections = set(re.findall(r"^## `([\w.]+\.py)`", readme.read_text(), re.MULTILINE))
    unlinked = {m.group(1) for row in rows if (m := re.match(r"\| `([\w.]+\.py)`", row))}
    assert not unlinked & sections, f"the index does not link {sorted(unlinked & sections)} to its section"
    links = re.findall(r"\]\(([^)\s]+)\)", index)
    for link in links:
        if "://" in link:
            continue
        target, _, anchor = link.partition("#")
        path = (readme.parent / target) if target else readme
        assert path.exists(), f"the index links to {target}, which does not exist"
        if anchor:
            assert anchor in anchors(path), f"#{anchor} is no heading of {path.name}"
