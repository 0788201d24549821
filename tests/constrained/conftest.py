"""A tiny random-weight Llama with the embedded model's 49,152-token vocabulary, borrowing its
tokenizer: the grammar alone decides what is well-formed, and a step takes milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit import Engine
from labkit.model_loader.loader import CONFIGS_DIR


@pytest.fixture(scope="session")
def tiny_vocab_config(tmp_path_factory) -> str:
    config = json.loads((CONFIGS_DIR / "tiny-llama.json").read_text())
    config |= {"vocab_size": 49152, "max_position_embeddings": 2048}
    path = Path(tmp_path_factory.mktemp("configs")) / "tiny-llama-49k.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def tiny_engine_kwargs(tiny_vocab_config, embedded_dir) -> dict:
    """Engine keywords for the tiny model with the embedded tokenizer."""
    return {
        "model_path": tiny_vocab_config,
        "load_format": "dummy",
        "tokenizer_path": str(embedded_dir),
        "max_total_tokens": 8192,
        "device": "cpu",
    }


@pytest.fixture(scope="module")
def engine(tiny_engine_kwargs):
    return Engine(**tiny_engine_kwargs)
