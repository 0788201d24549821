"""Triton kernels (import path labkit.kernels), each with a plain-PyTorch reference in
labkit.kernels.reference: store_kv (kv_cache.py), decode_attention (decode.py), extend_attention
(extend.py), rmsnorm and fused_add_rmsnorm (norm.py), rotary_embedding (rotary.py), silu_and_mul
(activation.py). `python -m labkit.kernels.bench` times the attention kernels on a GPU.

Without a CUDA device Triton can only run kernels through its interpreter (numpy on the CPU, slow
but exact enough for tests and teaching). The interpreter is chosen when a kernel is defined, so
importing this package on a machine without CUDA turns it on (TRITON_INTERPRET=1) unless the
variable is already set, before any kernel module below is imported."""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from labkit.kernels.activation import silu_and_mul  # noqa: E402
from labkit.kernels.decode import decode_attention, decode_kv_splits  # noqa: E402
from labkit.kernels.extend import ExtendPlan, extend_attention  # noqa: E402
from labkit.kernels.norm import fused_add_rmsnorm, rmsnorm  # noqa: E402
from labkit.kernels.rotary import rotary_embedding  # noqa: E402
from labkit.kernels.kv_cache import store_kv  # noqa: E402

__all__ = [
    "ExtendPlan", "decode_attention", "decode_kv_splits", "extend_attention", "fused_add_rmsnorm",
    "rmsnorm", "rotary_embedding", "silu_and_mul", "store_kv",
]
