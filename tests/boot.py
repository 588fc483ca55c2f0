"""Loaded before pytest's plugins by the README's test command (``-p tests.boot`` in scripts/test.sh).

nbval imports nbformat, whose jsonschema imports ``rfc3987_syntax`` when it is installed (Jupyter's
event schemas pull it in): it builds an Earley parser for IRIs at import, 1.4–2.4 s of CPU in every
pytest process (the controller and each worker), for a format check no notebook here uses. Marked
as absent in the test processes only, jsonschema leaves that one format unchecked.
"""
import sys

sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[assignment]
