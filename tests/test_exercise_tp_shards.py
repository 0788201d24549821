"""Notebook 08's Build-it: check_shards passes the given rank_slice and rejects slicings that differ
from what labkit's tensor-parallel layers load (a random HF Llama of the tiny config, its vocabulary
cut to 250 so that tp_size 4 pads the embedding, and 2 KV heads so that tp_size 4 replicates them)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from labkit.distributed.parallel_state import TPGroup
from labkit.model_loader.loader import load_config
from labkit.models.registry import get_model_class
from tests.notebook_cells import run_cells

TP_SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def notebook():
    names = {"torch": torch, "TPGroup": TPGroup, "get_model_class": get_model_class}
    return run_cells("08_parallelism", "build-shards-answer", "build-shards-check", **names)


@pytest.fixture(scope="module")
def tiny():
    config = load_config("tiny-llama")
    config.vocab_size = 250
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(config).state_dict()
    return config, {n: t for n, t in weights.items() if ".layers.0." in n or "embed_tokens" in n}


def check(notebook, tiny, rank_slice):
    config, checkpoint = tiny
    notebook["check_shards"](rank_slice, config, checkpoint, TP_SIZES)


def test_the_notebooks_answer_passes(notebook, tiny, capsys):
    check(notebook, tiny, notebook["rank_slice"])
    assert "your slices are every rank's at tp_size 1, 2, 4" in capsys.readouterr().out


def wrong(right, change):
    """`right` (the notebook's rank_slice), except where `change(name, full, rank, size, config)`
    returns a tensor."""

    def rank_slice(name, full, rank, size, config):
        changed = change(name, full, rank, size, config)
        return right(name, full, rank, size, config) if changed is None else changed

    return rank_slice


def _rows(full, rank, size):
    n = full.shape[0] // size
    return full[rank * n : (rank + 1) * n]


def splits_kv_heads_below_tp_size(name, full, rank, size, config):
    return _rows(full, rank, size) if name.endswith(("k_proj.weight", "v_proj.weight")) else None


def replicates_the_wrong_kv_head(name, full, rank, size, config):
    if name.endswith(("k_proj.weight", "v_proj.weight")) and config.num_key_value_heads < size:
        head = rank % config.num_key_value_heads
        return full[head * config.head_dim : (head + 1) * config.head_dim]
    return None


def row_parallel_sliced_by_rows(name, full, rank, size, config):
    return _rows(full, rank, size) if name.endswith("o_proj.weight") else None


def every_rank_takes_the_first_columns(name, full, rank, size, config):
    return full[:, : full.shape[1] // size] if name.endswith("down_proj.weight") else None


def down_proj_sliced_by_rows(name, full, rank, size, config):
    return _rows(full, rank, size) if name.endswith("down_proj.weight") else None


def unpadded_embedding(name, full, rank, size, config):
    if name.endswith("embed_tokens.weight"):
        rows = -(-full.shape[0] // size)
        return full[rank * rows : (rank + 1) * rows]
    return None


def ranks_in_reverse(name, full, rank, size, config):
    return _rows(full, size - 1 - rank, size) if name.endswith("gate_proj.weight") else None


def sliced_norms(name, full, rank, size, config):
    return _rows(full, rank, size) if "norm" in name else None


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (splits_kv_heads_below_tp_size, r"tp_size 4, rank 0, .*qkv_proj.weight: yours is"),
        (replicates_the_wrong_kv_head, r"tp_size 4, rank 1, .*qkv_proj.weight: the right shape"),
        (row_parallel_sliced_by_rows, r"rank 0, .*o_proj.weight: yours is \(32, 64\), the rank holds \(64, 32\)"),
        (every_rank_takes_the_first_columns, r"tp_size 2, rank 1, .*down_proj.weight: the right shape"),
        (down_proj_sliced_by_rows, r"down_proj.weight: yours is"),
        (unpadded_embedding, r"tp_size 4, rank 3, model.embed_tokens.weight: yours is \(61, 64\)"),
        (ranks_in_reverse, r"tp_size 2, rank 0, .*gate_up_proj.weight: the right shape"),
        (sliced_norms, r"tp_size 2, rank 0, .*layernorm.weight: yours is"),
    ],
)
def test_check_shards_rejects_a_wrong_slicing(notebook, tiny, change, complaint):
    with pytest.raises(AssertionError, match=complaint):
        check(notebook, tiny, wrong(notebook["rank_slice"], change))
