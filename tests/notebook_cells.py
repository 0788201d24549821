"""Code cells of the teaching notebooks, for the tests of their Build-it exercises: a test runs a
notebook's check function on wrong answers (it must reject each) without running the notebook."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"


def cell_source(stem: str, cell_id: str) -> str:
    """The source of the code cell with id `cell_id` in notebooks/<stem>.ipynb."""
    cells = json.loads((NOTEBOOK_DIR / f"{stem}.ipynb").read_text())["cells"]
    found = [c for c in cells if c.get("id") == cell_id]
    if len(found) != 1 or found[0]["cell_type"] != "code":
        raise LookupError(f"{stem}.ipynb has no code cell with id {cell_id!r}")
    source = found[0]["source"]
    return "".join(source) if isinstance(source, list) else source


def run_cells(stem: str, *cell_ids: str, **names: Any) -> dict[str, Any]:
    """Run the given cells, in order, in one namespace that starts with `names` (what the notebook's
    earlier cells import or define); return the namespace."""
    namespace: dict[str, Any] = dict(names)
    for cell_id in cell_ids:
        exec(compile(cell_source(stem, cell_id), f"{stem}.ipynb:{cell_id}", "exec"), namespace)
    return namespace
