"""Attention backends. Importing this package registers the built-in ones."""

from labkit.attention import torch_native  # noqa: F401  (registers "torch_native")
from labkit.attention.base import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionBackendConfig,
    AttentionLayerSpec,
    get_attention_backend,
    register_attention_backend,
    resolve_attention_backend,
)
from labkit.attention.torch_native import TorchNativeAttnBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionBackendConfig",
    "AttentionLayerSpec",
    "TorchNativeAttnBackend",
    "get_attention_backend",
    "register_attention_backend",
    "resolve_attention_backend",
]
