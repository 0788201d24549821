"""Model loading: HF directories, random ("dummy") weights, and the embedded default model."""

from labkit.model_loader.embedded import embedded_model_dir
from labkit.model_loader.loader import load_config, load_model, load_tokenizer, resolve_model_dir

__all__ = ["embedded_model_dir", "load_config", "load_model", "load_tokenizer", "resolve_model_dir"]
