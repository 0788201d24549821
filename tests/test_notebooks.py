"""The teaching notebooks run top to bottom (nbclient, a kernel on this interpreter) and are stored
without outputs.

The kernel gets OMP_NUM_THREADS=1 unless the caller sets it: on a small shared CPU box, torch's
worker threads spin-wait while other processes hold the cores, which made the same notebook cell
many times slower with 2 threads than with 1 on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
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
        "07_kernels",
        "08_parallelism",
        "09_moe",
        "10_speculative_decoding",
        "11_structured_output_and_programs",
        "12_sampling",
        "13_packed_batches",
        "14_overlap_scheduling",
        "15_incremental_detokenization",
        "16_memory_hierarchy",
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
@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=pytest.mark.xdist_group(p.stem)) for p in NOTEBOOKS], ids=lambda p: p.stem
)
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


@pytest.mark.slow
def test_the_notebooks_command_serves_jupyterlab_on_localhost_with_widgets():
    """`bash scripts/notebooks.sh` (the README's third command) starts JupyterLab on 127.0.0.1 with a
    Python kernel and the ipywidgets extension enabled."""
    import httpx

    from labkit.server.process import free_port

    port = free_port()
    root = NOTEBOOK_DIR.parent
    cmd = ["bash", "scripts/notebooks.sh", "--no-browser", f"--port={port}"]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        token, deadline, seen = None, time.monotonic() + 120, []
        while token is None and time.monotonic() < deadline and proc.stdout is not None:
            line = proc.stdout.readline()
            seen.append(line)
            if match := re.search(rf"http://127\.0\.0\.1:{port}/lab\?token=(\w+)", line):
                token = match.group(1)
        assert token, "".join(seen[-20:])
        base = f"http://127.0.0.1:{port}"
        specs = httpx.get(f"{base}/api/kernelspecs", params={"token": token}, timeout=30).json()
        assert "python3" in specs["kernelspecs"]
        extensions = httpx.get(f"{base}/lab/api/extensions", params={"token": token}, timeout=30).json()
        listed = extensions[0] if extensions and isinstance(extensions[0], list) else extensions
        # Listed as "jupyter-widgets-jupyterlab-manager" (the npm name @jupyter-widgets/jupyterlab-manager).
        widgets = [e for e in listed if e["name"].endswith("jupyter-widgets-jupyterlab-manager")]
        assert widgets and widgets[0]["enabled"], [e["name"] for e in listed]
    finally:
        proc.send_signal(signal.SIGINT)  # JupyterLab asks to confirm one Ctrl-C; a second one ends it
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
