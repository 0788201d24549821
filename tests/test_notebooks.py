"""The teaching notebooks run top to bottom (nbclient, a kernel on this interpreter) and are stored
without outputs.

The kernel gets OMP_NUM_THREADS=1 unless the caller sets it: on a small shared CPU box, torch's
worker threads spin-wait while other processes hold the cores, which made the same notebook cell
many times slower with 2 threads than with 1 on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds per cell
NOTEBOOK_BUDGET = 240  # seconds per notebook on a 2-core CPU box (all of them: a few minutes)


@pytest.fixture(scope="module")
def kernel_spec_dir(tmp_path_factory):
    """A kernelspec that runs ipykernel on this very interpreter (not whatever `python` is on PATH)."""
    root = tmp_path_factory.mktemp("kernels")
    spec = root / "labkit-test"
    spec.mkdir()
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "labkit test", "language": "python",
    }))  # fmt: skip
    return root


def test_the_teaching_notebooks_are_there():
    names = {p.stem for p in NOTEBOOKS}
    assert {
        "01_request_journey",
        "02_radix_cache",
        "03_continuous_batching",
        "04_paged_memory",
        "05_scheduling_policies",
        "06_serving",
        "08_parallelism",
    } <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} has stored outputs"
            assert cell.execution_count is None, f"cell {i} has an execution count"
    assert "widgets" not in nb.metadata, "stored widget state"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, kernel_spec_dir):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(path, as_version=4)
    specs = KernelSpecManager(kernel_dirs=[str(kernel_spec_dir)])
    km = KernelManager(kernel_name="labkit-test", kernel_spec_manager=specs)
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT, allow_errors=False, resources={"metadata": {"path": str(NOTEBOOK_DIR)}}
    )
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    try:
        client.execute(env=env)  # raises CellExecutionError with the cell and traceback on failure
    finally:
        # nbclient leaves a kernel it did not start (we pass km) running: each one kept its notebook's
        # engines in memory until the test session ended, and together they ran CI out of memory.
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    elapsed = time.perf_counter() - start
    assert elapsed < NOTEBOOK_BUDGET, f"{path.name} took {elapsed:.0f} s"
