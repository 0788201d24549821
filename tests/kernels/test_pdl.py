"""When kernels launch programmatically dependent on the kernel ahead (labkit.kernels.pdl): decode-
sized launches on Hopper-class CUDA devices only. That PDL launches compute the right thing, in
and out of CUDA graphs, is what every kernel test and tests/test_cuda_graph.py check on such a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import labkit.kernels.pdl
from labkit.kernels.pdl import PDL_MAX_TOKENS, pdl_options

CUDA = torch.cuda.is_available()


def test_pdl_is_off_without_cuda():
    assert pdl_options(torch.device("cpu"), 1) == {"PDL": False}


def test_pdl_is_off_for_prefill_sized_launches():
    assert pdl_options(torch.device("cuda"), PDL_MAX_TOKENS + 1) == {"PDL": False}


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_pdl_is_on_for_decode_launches_on_hopper_unless_disabled(monkeypatch):
    on = torch.cuda.get_device_capability()[0] >= 9
    expected = {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
    assert pdl_options(torch.device("cuda"), PDL_MAX_TOKENS) == expected
    monkeypatch.setattr(labkit.kernels.pdl, "ENABLED", False)  # LABKIT_DISABLE_PDL=1
    assert pdl_options(torch.device("cuda"), 1) == {"PDL": False}


def test_the_environment_switch_turns_pdl_off():
    code = "import labkit.kernels.pdl as p; print(p.ENABLED)"
    env = {**os.environ, "LABKIT_DISABLE_PDL": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
