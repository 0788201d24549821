"""The suite's pytest configuration turns a hung test into a failure that names it and prints where every
thread waited, instead of holding CI until its limit (pyproject.toml: faulthandler_timeout, timeout)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HUNG = """
import threading

def test_waits_for_a_lock_nobody_releases():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()

def test_after_it():
    pass
"""


def test_a_test_blocked_forever_fails_after_the_timeout_with_its_stack(tmp_path):
    (tmp_path / "test_hung.py").write_text(HUNG)
    # The project's configuration with its two limits shortened; two workers as in CI.
    cmd = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
    cmd += ["-o", "faulthandler_timeout=2", "-o", "timeout=4", "-p", "no:cacheprovider", "-n", "2"]
    out = subprocess.run([*cmd, str(tmp_path / "test_hung.py")], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert 'test_hung.py", line 7 in test_waits_for_a_lock_nobody_releases' in text, text  # where it waited
    assert "crashed while running 'test_hung.py::test_waits_for_a_lock_nobody_releases'" in text, text
    assert "1 failed, 1 passed" in text, text  # the worker was replaced and the rest ran
