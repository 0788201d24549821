"""Model building blocks shared by all architectures."""

from labkit.layers.activation import SiluAndMul
from labkit.layers.attention import Attention
from labkit.layers.logits import LogitsProcessor
from labkit.layers.rmsnorm import RMSNorm
from labkit.layers.rotary import RotaryEmbedding, get_rope

__all__ = ["Attention", "LogitsProcessor", "RMSNorm", "RotaryEmbedding", "SiluAndMul", "get_rope"]
