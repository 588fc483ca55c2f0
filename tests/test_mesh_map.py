"""The map of the mesh's parts in ``devices/mesh.py``'s docstring names modules that exist, and every module named for a part of the mesh."""
from __future__ import annotations

import pathlib
import re

from pipexplore.devices import mesh

PACKAGE = pathlib.Path(mesh.__file__).resolve().parents[1]
NAMED = re.compile(r"``([a-z_]+/)?([a-z_]+\.py)``")


def _listed() -> set[str]:
    doc = mesh.__doc__ or ""
    table = doc[doc.index("Where the mesh's other parts live"):]
    listed, folder = set(), ""
    for line in table.splitlines():
        if not line.startswith("``"):
            continue  # the table's rows only
        for found in NAMED.finditer(line):
            folder = found.group(1) or folder  # ``models/ep_rank.py``, ``experts.py``: the same folder
            listed.add(folder + found.group(2))
    return listed


def test_every_module_the_map_names_exists():
    listed = _listed()
    assert len(listed) >= 10
    missing = sorted(name for name in listed if not (PACKAGE / name).is_file())
    assert not missing, f"devices/mesh.py's map names modules that do not exist: {missing}"


def test_every_module_named_for_a_part_of_the_mesh_is_on_the_map():
    parts = re.compile(r"mesh|expert|ep_rank|shard|collective|fsdp|links")
    named = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
             if parts.search(path.stem) and path.parent not in (PACKAGE, PACKAGE / "backend")
             and path.name != "__init__.py"}  # (backend/: hivemind's expert servers, not the mesh)
    named.discard("devices/mesh.py")
    unlisted = sorted(named - _listed())
    assert not unlisted, f"add these to the map in devices/mesh.py's docstring: {unlisted}"
