"""Triton kernels (import path labkit.kernels), each with a plain-PyTorch reference in
labkit.kernels.reference: store_kv (kv_cache.py), decode_attention (decode.py), extend_attention
(extend.py), rmsnorm and fused_add_rmsnorm (norm.py), rotary_embedding and rotary_embedding_store
(rotary.py; the second also stores K/V as store_kv does), silu_and_mul (activation.py),
moe_align_block_size (moe_align.py) and fused_moe (fused_moe.py); and gemv, gemv_rmsnorm and
gemv_silu_and_mul (gemv.py: a one-row linear layer, alone or after the norm or the activation that
precedes it, split along K where the weight is tall; the references are F.linear after those;
gemv_all_reduce.py sums a row-parallel layer's products over the ranks in the GEMV's epilogue). The
decode-path kernels (gemv, rotary, store_kv, decode_attention) launch programmatically dependent on
the kernel ahead on Hopper-class GPUs (pdl.py).
`python -m labkit.kernels.bench` times the attention kernels on a GPU, `python -m
labkit.kernels.bench_moe` the mixture-of-experts kernels.

Without a CUDA device Triton can only run kernels through its interpreter (numpy on the CPU, slow
but exact enough for tests and teaching). Triton reads that switch (TRITON_INTERPRET=1) when it
defines a kernel, its own `tl.sum` & co. included, which it does on first import, so labkit/__init__.py
sets the switch just before Triton is first imported (by this package or by torch.compile)."""

from labkit.kernels.activation import silu_and_mul
from labkit.kernels.decode import decode_attention, decode_kv_splits
from labkit.kernels.extend import ExtendPlan, extend_attention
from labkit.kernels.fused_moe import fused_moe
from labkit.kernels.gemv import Split as GemvSplit
from labkit.kernels.gemv import gemv, gemv_rmsnorm, gemv_silu_and_mul
from labkit.kernels.gemv import max_rows as gemv_max_rows
from labkit.kernels.gemv import semaphore_count as gemv_semaphore_count
from labkit.kernels.gemv_qkv import QKVHeads, fuses_qkv, gemv_qkv_rope_store
from labkit.kernels.kv_cache import store_kv, stores_into
from labkit.kernels.moe_align import moe_align_block_size
from labkit.kernels.norm import fused_add_rmsnorm, rmsnorm
from labkit.kernels.rotary import rotary_embedding, rotary_embedding_store

__all__ = [
    "ExtendPlan",
    "QKVHeads",
    "decode_attention",
    "decode_kv_splits",
    "extend_attention",
    "fused_add_rmsnorm",
    "fused_moe",
    "fuses_qkv",
    "GemvSplit",
    "gemv",
    "gemv_qkv_rope_store",
    "gemv_max_rows",
    "gemv_rmsnorm",
    "gemv_semaphore_count",
    "gemv_silu_and_mul",
    "moe_align_block_size",
    "rmsnorm",
    "rotary_embedding",
    "rotary_embedding_store",
    "silu_and_mul",
    "store_kv",
    "stores_into",
]
