"""labkit: a modular LLM serving engine to learn, research and run serving."""

import os

import torch

# Without CUDA, labkit.kernels' Triton kernels run in Triton's interpreter. Triton reads the switch
# when it is first imported (it defines its own jit helpers then), and the imports below bring it in
# through torch.compiler, so it is set here, first. A process that imported Triton before labkit
# must set TRITON_INTERPRET=1 itself.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from labkit.config import EngineConfig
from labkit.engine import Engine, EngineStep
from labkit.sampling.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStep", "SamplingParams"]
