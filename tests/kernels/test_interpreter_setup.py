"""Without CUDA the kernels run in Triton's interpreter, in the tests and in a plain process."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the compiled kernels")


def test_kernels_are_interpreted_in_this_session():
    from labkit.kernels.kv_cache import _store_kv_kernel

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert type(_store_kv_kernel).__name__ == "InterpretedFunction"


def test_a_plain_cpu_process_runs_the_triton_backend():
    """The Engine imports Triton (through torch.compile and labkit.kernels); the interpreter switch
    must be set before that, by labkit itself: a fresh process without TRITON_INTERPRET runs the
    triton backend."""
    code = (
        "from labkit import Engine\n"
        "e = Engine(model_path='tiny-llama', load_format='dummy', attention_backend='triton')\n"
        "params = {'max_new_tokens': 2, 'ignore_eos': True}\n"
        "print(e.generate(input_ids=[1, 2, 3, 4], sampling_params=params)['output_ids'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(ast.literal_eval(done.stdout.strip().splitlines()[-1])) == 2
