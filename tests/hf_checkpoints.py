"""Random-weight HF checkpoints of the tiny data/configs models, saved by transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from labkit.model_loader import load_config


def random_hf_checkpoint(name: str, tie: bool, rope: dict | None, path: Path) -> torch.nn.Module:
    """transformers' model of config `name` with every weight random (HF zero-inits biases and
    ones-inits norms, which would hide mistakes), saved to `path`; returns it (eager attention)."""
    config = load_config(name)
    config.tie_word_embeddings = tie
    if rope is not None:
        config.rope_parameters = rope
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in pname else 0.1 * noise)
    hf.save_pretrained(path)
    return hf
