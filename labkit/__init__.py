"""labkit: a modular LLM serving engine to learn, research and run serving."""
from labkit.config import EngineConfig
from labkit.engine import Engine, EngineStep
from labkit.sampling.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStep", "SamplingParams"]
