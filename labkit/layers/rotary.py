"""Rotary position embedding, neox style (rotate halves), as in HF Llama / Qwen2 / Qwen3."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from labkit.layers.fused import triton_kernels, use_triton_kernels

if TYPE_CHECKING:
    from labkit.layers.rmsnorm import RMSNorm


def rope_parameters(config: Any) -> dict[str, Any]:
    """Rope settings from a HF config: transformers-5 `rope_parameters`, or the older `rope_theta` +
    `rope_scaling` attributes. Always has "rope_type" and "rope_theta"."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def compute_inv_freq(head_dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32, CPU) for rope types "default" and "llama3"."""
    base = float(params["rope_theta"])
    # Explicit CPU device: models are built under torch.device("meta"), and this must be real.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, llama3)")
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params.get("original_max_position_embeddings", max_position)
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept; the band between is interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rope to q [T, H, D] and k [T, H_kv, D] at `positions` [T].

    cos/sin are computed from the positions on the fly in float32 (cheap: T x D/2), which keeps no
    large cache and survives meta-device construction; inv_freq is a plain attribute, not a buffer."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_position: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._inv_freq_cpu = compute_inv_freq(head_dim, params, max_position)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> rotation angles [T, D/2] in float32."""
        device = positions.device
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq_cpu.to(device)
        return positions.float()[:, None] * self._inv_freq[device][None, :]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, D] for `positions`; a model computes them once per forward, not
        per layer. The sin's first half is negated so that rotate_half becomes a flip (see apply_rope)."""
        freqs = self._angles(positions)
        cos, sin = freqs.cos(), freqs.sin()
        return (
            torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype),
            torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype),
        )

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """One forward's rotary inputs for every layer: cos/sin for the torch ops, or on CUDA one
        float32 [T, D] table (cos | sin halves) that the fused Triton kernel reads at rows 0..T-1."""
        if not use_triton_kernels(positions):
            return RopeInputs(cos_sin=self.cos_sin(positions, dtype))
        return self.kernel_inputs(positions)

    def kernel_inputs(self, positions: torch.Tensor) -> RopeInputs:
        """The fused kernel's inputs (prepare's CUDA branch; any device, for tests on the interpreter)."""
        freqs = self._angles(positions)
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return RopeInputs(table=table, rows=torch.arange(table.shape[0], device=table.device))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prepare(positions, q.dtype).apply(q, k)


@dataclass
class RopeInputs:
    """RotaryEmbedding.prepare's result: either cos_sin, or table and rows."""

    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    table: torch.Tensor | None = None
    rows: torch.Tensor | None = None

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope on q [T, H, D] and k [T, H_kv, D]. With q_norm and k_norm (Qwen3), each head is
        RMS-normalized first; on CUDA in the same kernel, which reads the strided q/k views as they are."""
        if self.table is None:
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            return apply_rope(q, k, *self.cos_sin)
        return triton_kernels().rotary_embedding(self.rows, q, k, self.table, **_norm_kwargs(q_norm, k_norm))

    def apply_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        loc: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """apply's q, with the rotated k and v [T, H_kv, D] written into a KV pool's buffers (of q's
        dtype, or float8 quantized by the layer's scales) at slots loc, in one kernel
        (labkit.kernels.rotary_embedding_store). CUDA only: the fused kernel's table (prepare on CUDA)."""
        assert self.table is not None, "apply_and_store needs the fused kernel's table"
        return triton_kernels().rotary_embedding_store(
            self.rows, q, k, v, self.table, k_buffer, v_buffer, loc, **_norm_kwargs(q_norm, k_norm),
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip


def _norm_kwargs(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> dict[str, Any]:
    """The fused kernel's arguments for the per-head q/k norms (none without them)."""
    if q_norm is None or k_norm is None:
        return {}
    if q_norm.eps != k_norm.eps:
        raise ValueError("the fused q/k norm takes one eps for both")
    return {"norm_weights": (q_norm.weight, k_norm.weight), "eps": q_norm.eps}


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x*cos + rotate_half(x)*sin, where rotate_half(x) = [-x2, x1] = flip of the halves times the
    # sign already folded into signed_sin: three ops instead of six (this runs in every layer).
    halves = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, halves, signed_sin)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding on q [T, H, D] and k [T, H_kv, D] with RotaryEmbedding.cos_sin's output."""
    return _rope(q, cos, signed_sin), _rope(k, cos, signed_sin)


def get_rope(head_dim: int, config: Any) -> RotaryEmbedding:
    """Build the rotary embedding described by a HF config."""
    return RotaryEmbedding(head_dim, rope_parameters(config), config.max_position_embeddings)
