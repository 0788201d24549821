"""The two memory pools: request slots (ReqToTokenPool) and per-layer KV storage (TokenToKVPool).
KV slot allocation is the allocator's job (allocator.py); these classes only own the tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeGuard

import torch

from labkit.config import KV_CACHE_DTYPES
from labkit.reprs import Summarized

# --kv-cache-dtype's float8 formats (SGLang's names) and the torch dtypes that store them.
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's storage dtype for --kv-cache-dtype `name`: auto is the model's dtype."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {name!r}; choose one of {list(KV_CACHE_DTYPES)}")
    return FP8_KV_DTYPES.get(name, model_dtype)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES.values()


def is_positive_finite(x: object) -> TypeGuard[float]:
    """Whether x is a real number (an int or float, not a bool) in (0, inf): what scales and sizes
    given by a checkpoint or an option must be."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as the pool stores it in `dtype`: for a float8 dtype x / scale (in float32), saturated to
    the format's finite range (a plain cast of a too-large value gives inf in e5m2, and NaN or the
    largest value in e4m3fn depending on torch's build and device), then rounded to nearest even;
    any other dtype is a plain cast (the scale is not used)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    finfo = torch.finfo(dtype)
    return (x.float() / scale).clamp_(finfo.min, finfo.max).to(dtype)


def dequantize_kv(raw: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored values `raw` as `dtype`: cast, then (float8 storage only) multiplied by the scale."""
    if not is_fp8(raw.dtype):
        return raw.to(dtype)
    return raw.to(dtype, copy=True).mul_(scale)  # a copy even into raw's dtype: never scale the pool itself


class ReqToTokenPool(Summarized):
    """req_to_token[r, i] is the KV slot holding token i of the request in slot r.

    Two copies on a GPU: `req_to_token` on the device, read by the attention kernels, and `host` on
    the CPU, read by the scheduler and the prefix cache. Reading the device copy from the host would
    wait for the GPU and undo overlap scheduling, so writes go through `write`, which updates both
    (the device copy with a non-blocking copy, ordered on the stream after the forwards already
    queued). On a CPU device they are one tensor."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.host = (
            self.req_to_token if self.device.type == "cpu" else torch.zeros_like(self.req_to_token, device="cpu")
        )
        self.free_slots: list[int] = list(range(size))

    def write(self, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> None:
        """req_to_token[rows[k], cols[k]] = values[k] (CPU int64 tensors of one length)."""
        self.host[rows, cols] = values
        if self.host is not self.req_to_token:
            packed = torch.stack((rows, cols, values)).to(self.device, non_blocking=True)
            self.req_to_token[packed[0], packed[1]] = packed[2]

    def write_row(self, slot: int, start: int, values: torch.Tensor) -> None:
        """req_to_token[slot, start : start + len(values)] = values (a CPU tensor of integers): one
        slice write per copy, where `write` builds index tensors and scatters on the device (on a
        GPU host that cost a batch-1 decode step about 110 us, docs/benchmarks.md)."""
        end = start + values.numel()
        self.host[slot, start:end] = values
        if self.host is not self.req_to_token:
            self.req_to_token[slot, start:end].copy_(values, non_blocking=True)

    def summary(self) -> dict[str, object]:
        return {"slots": self.size, "free": self.available_size(), "max_context_len": self.max_context_len}

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int = 1) -> list[int] | None:
        if n > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return taken

    def free(self, slot: int) -> None:
        if slot in self.free_slots:
            raise RuntimeError(f"request slot {slot} freed twice")
        self.free_slots.append(slot)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class TokenToKVPool(Summarized):
    """K and V tensors per layer, [num_slots, num_kv_heads, head_dim] of `dtype` (the storage dtype:
    the model's, or a float8 one for --kv-cache-dtype fp8_*). The first page (slots
    0..page_size-1) is never handed out: padded tokens write there, so no real KV is overwritten.

    `k_buffer[layer]` / `v_buffer[layer]` are the raw storage: a float8 pool holds K / k_scale[layer]
    and V / v_scale[layer] (quantize_kv), and whoever reads values from them dequantizes
    (dequantize_kv; the Triton kernels take the scales as arguments). Copying them raw (a host pool)
    needs no scale."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
    ):
        self.size = size  # usable slots, excluding the reserved first page
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Per-layer float8 scales (SGLang's k_scale / v_scale): 1.0 unless set_kv_scales gives the
        # checkpoint's. Unused by a pool in the model's dtype.
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        shape = (size + page_size, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def set_kv_scales(self, k_scales: Sequence[float], v_scales: Sequence[float]) -> None:
        """Use these per-layer scales (a checkpoint's) from now on. Call it before the first forward:
        KV already stored keeps the old scales, and CUDA graphs capture the values as kernel
        arguments. ValueError, leaving the scales as they were, unless each is one positive finite
        number per layer."""
        for which, scales in (("K", k_scales), ("V", v_scales)):
            if len(scales) != self.num_layers:
                raise ValueError(f"{len(scales)} {which} scales for a KV pool of {self.num_layers} layers")
            bad = [(i, x) for i, x in enumerate(scales) if not is_positive_finite(x)]
            if bad:
                layer, value = bad[0]
                raise ValueError(
                    f"KV scales must be positive finite numbers: {which} scale of layer {layer} is {value!r}"
                    + (f" ({len(bad) - 1} more bad)" if len(bad) > 1 else "")
                )
        self.k_scale = [float(x) for x in k_scales]
        self.v_scale = [float(x) for x in v_scales]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [len(loc), H_kv, D] at slots loc, quantized as quantize_kv does."""
        self.k_buffer[layer_id][loc] = quantize_kv(k, self.k_scale[layer_id], self.dtype)
        self.v_buffer[layer_id][loc] = quantize_kv(v, self.v_scale[layer_id], self.dtype)

    def get_kv(self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V values at slots loc, dequantized into `dtype`."""
        return (
            dequantize_kv(self.k_buffer[layer_id][loc], self.k_scale[layer_id], dtype),
            dequantize_kv(self.v_buffer[layer_id][loc], self.v_scale[layer_id], dtype),
        )

    def summary(self) -> dict[str, object]:
        per_token = self.bytes_per_token()
        return {
            "tokens": self.size,
            "page_size": self.page_size,
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "bytes_per_token": per_token,
            "MiB": round(self.nbytes() / 2**20, 1),
        }

    def nbytes(self) -> int:
        """Bytes of all K and V buffers, the reserved page included."""
        return (self.size + self.page_size) * self.bytes_per_token()

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k_buffer[0].element_size()
