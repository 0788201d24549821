"""Filling one parameter from its full tensor: tensor-parallel layers take their rank's slice
(each parallel layer's `load`), every other parameter is copied whole. And the checkpoint tensors that
are not parameters: per-layer KV cache scales (kv_scales_from)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)


def owner_of(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def full_shape_of(model: nn.Module, param_name: str, param: nn.Parameter) -> tuple[int, ...]:
    """The unsharded shape of a parameter (a parallel layer's bias is its weight's first dimension)."""
    shape = getattr(owner_of(model, param_name), "full_shape", None)
    if shape is None:
        return tuple(param.shape)
    return tuple(shape) if param_name.endswith("weight") else (shape[0],)


@torch.no_grad()
def load_param(
    model: nn.Module, param_name: str, param: nn.Parameter, full: torch.Tensor, block: int | None = None
) -> None:
    """Copy this rank's part of `full` (the whole parameter, or block `block` of a fused one) into it."""
    owner = owner_of(model, param_name)
    load = getattr(owner, "load", None)
    if load is not None:
        load(param, full, block)
        return
    if param.shape != full.shape:
        raise ValueError(f"{param_name}: checkpoint shape {tuple(full.shape)} != {tuple(param.shape)}")
    param.data.copy_(full)


# Per-layer float8 KV cache scales in HF fp8 checkpoints (vLLM / SGLang / llm-compressor names; the
# older `kv_scale` sets both) -> which of K and V each one sets. They are not weights: the KV pool
# owns them (TokenToKVPool.set_kv_scales).
_KV_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|[kv]_proj\.output_scale)$")
_KV_SCALE_SETS = {
    "k_scale": "k",
    "v_scale": "v",
    "kv_scale": "kv",
    "k_proj.output_scale": "k",
    "v_proj.output_scale": "v",
}


def is_kv_scale(name: str) -> bool:
    """Whether checkpoint tensor `name` is a per-layer KV cache scale rather than a weight."""
    return _KV_SCALE_NAME.match(name) is not None


@dataclass
class KVScales:
    """A checkpoint's per-layer KV cache scales, one float per layer each (1.0 where the checkpoint has
    none for a layer): a float8 pool stores K / k[layer] and V / v[layer]. Unvalidated: the pool
    checks the values."""

    k: list[float]
    v: list[float]


def kv_scales_from(tensors: Iterable[tuple[str, torch.Tensor]], num_layers: int) -> KVScales | None:
    """The KV scales among (name, tensor) pairs named as is_kv_scale says; None when there are none.
    ValueError for a scale of a layer the model lacks or one that is not a single number (per-head
    or per-channel scales are not supported)."""
    found: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for name, tensor in tensors:
        match = _KV_SCALE_NAME.match(name)
        if match is None:
            continue
        layer = int(match[1])
        if layer >= num_layers:
            raise ValueError(f"checkpoint KV scale {name!r} is for layer {layer}, but the model has {num_layers}")
        if tensor.numel() != 1:
            raise ValueError(
                f"checkpoint KV scale {name!r} has shape {tuple(tensor.shape)}; only one scale per layer "
                "(a single number) is supported"
            )
        for which in _KV_SCALE_SETS[match[2]]:
            found[which][layer] = float(tensor.float().item())
    if not found["k"] and not found["v"]:
        return None
    k, v = ([found[w].get(i, 1.0) for i in range(num_layers)] for w in "kv")
    missing = 2 * num_layers - len(found["k"]) - len(found["v"])
    if missing:
        logger.warning(
            "KV scales: the checkpoint lacks %d of the %d per-layer K and V scales; those stay 1.0",
            missing,
            2 * num_layers,
        )
    return KVScales(k, v)
