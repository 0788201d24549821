"""labkit models (paged KV, torch_native backend) vs transformers on the full sequence, float32."""

from __future__ import annotations

import pytest
import torch
from hf_checkpoints import random_hf_checkpoint

from labkit.model_executor.forward_batch import ForwardMode
from labkit.model_loader import load_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = [  # (data config, tie_word_embeddings, rope override)
    ("tiny-llama", True, None),
    ("tiny-llama", False, None),
    ("tiny-llama", False, LLAMA3_ROPE),
    ("tiny-qwen2", False, None),
    ("tiny-qwen2", True, None),
    ("tiny-qwen3", True, None),
    ("tiny-qwen3", False, None),
    ("tiny-qwen2-moe", False, None),  # shared expert, a dense layer among the sparse ones
    ("tiny-qwen2-moe", True, None),
    ("tiny-qwen3-moe", True, None),  # renormalized top-4 of 16 experts, q/k norm
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-tie{c[1]}-{'llama3rope' if c[2] else 'rope'}")
def checkpoint(request, tmp_path_factory):
    """(HF model, its saved directory), built once per case and shared by both page sizes."""
    path = tmp_path_factory.mktemp("ckpt")
    return random_hf_checkpoint(*request.param, path), path, request.param[1]


@pytest.mark.parametrize("page_size", [1, 4])
def test_matches_hf(checkpoint, page_size, paged_kv_harness):
    hf, path, tie = checkpoint
    model, config = load_model(str(path), "auto", torch.float32, "cpu")
    assert model.tie_word_embeddings == tie
    h = paged_kv_harness(
        config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim, page_size
    )

    gen = torch.Generator().manual_seed(2)
    seqs: dict[int, torch.Tensor] = {}  # req -> its full token sequence

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (n,), generator=gen)

    a, b, c = h.new_req(), h.new_req(), h.new_req()
    seqs[a], seqs[b], seqs[c] = tokens(20), tokens(14), tokens(12)
    steps: list[tuple[ForwardMode, list[tuple[int, int]]]] = [
        (ForwardMode.EXTEND, [(a, 9), (b, 5), (c, 3)]),
        (ForwardMode.DECODE, [(a, 1), (b, 1), (c, 1)]),
        (ForwardMode.DECODE, [(a, 1), (b, 1), (c, 1)]),
        ("share", None),  # d reuses a's first 4 slots, e reuses a's first 8
        (ForwardMode.MIXED, [(a, 1), ("d", 6), (b, 1), (c, 1)]),  # prefix extend among decodes
        (ForwardMode.EXTEND, [("e", 3), (c, 4)]),  # extend with prefix + a chunked-prefill chunk
        (ForwardMode.DECODE, [(a, 1), (b, 1), (c, 1), ("d", 1), ("e", 1)]),
        (ForwardMode.DECODE, [(a, 1), (b, 1), (c, 1), ("d", 1), ("e", 1)]),
    ]
    names: dict[str, int] = {}
    with torch.inference_mode():
        for mode, items in steps:
            if mode == "share":
                names["d"] = h.new_req(a, 4)
                names["e"] = h.new_req(a, 8)
                seqs[names["d"]] = torch.cat([seqs[a][:4], tokens(8)])
                seqs[names["e"]] = torch.cat([seqs[a][:8], tokens(5)])
                continue
            items = [(names.get(r, r), n) for r, n in items]
            ends = [h.lens[r] + n for r, n in items]
            ids = torch.cat([seqs[r][h.lens[r] : end] for (r, _), end in zip(items, ends)])
            fb = h.batch(mode, items, ids)
            fb.attn_backend.init_forward_metadata(fb)
            logits = model(fb.input_ids, fb.positions, fb)
            assert logits.dtype == torch.float32 and logits.shape == (len(items), config.vocab_size)
            for row, ((r, _), end) in enumerate(zip(items, ends)):
                ref = hf(seqs[r][:end][None]).logits[0, -1]
                tol = 1e-4 * max(1.0, ref.abs().max().item())
                torch.testing.assert_close(logits[row], ref, atol=tol, rtol=0)
