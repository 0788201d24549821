"""Model implementations; importing this package registers them all."""

from labkit.models import llama, qwen2, qwen2_moe, qwen3, qwen3_moe  # noqa: F401  (registration side effects)
from labkit.models.registry import get_model_class, register_model, supported_architectures

__all__ = ["get_model_class", "register_model", "supported_architectures"]
