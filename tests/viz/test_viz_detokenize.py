"""labkit.viz.detokenize: token bytes, byte-by-byte spelling and the two figures, on the embedded
model's tokenizer (a byte-level BPE)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from labkit.viz.detokenize import byte_token_ids, draw_decode_cost, draw_token_bytes, token_bytes


@pytest.fixture(scope="module")
def tok(embedded_dir):
    from labkit.model_loader import load_tokenizer

    return load_tokenizer(embedded_dir)


def gids(fig, prefix: str) -> list[str]:
    found = (a.get_gid() for ax in fig.axes for a in ax.get_children())
    return [g for g in found if g is not None and g.startswith(prefix)]


def test_token_bytes_concatenate_to_the_utf8_of_the_text(tok):
    text = 'He said "おく" 🌟 naïve'
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(tok, t) for t in ids) == text.encode()
    assert token_bytes(tok, tok.encode(" world", add_special_tokens=False)[0]) == b" world"
    with pytest.raises(ValueError, match="not a byte-level token"):
        token_bytes(tok, tok.eos_token_id)


def test_byte_token_ids_spell_any_utf8_text_one_byte_per_token(tok):
    byte_ids = byte_token_ids(tok)
    assert set(range(0x80, 0xC0)) <= set(byte_ids)  # every continuation byte
    assert {0xE3, 0xF0} <= set(byte_ids) and 0xFF not in byte_ids  # 0xFF never occurs in UTF-8
    text = "日本語 🇯🇵 e\u0301"
    ids = [byte_ids[b] for b in text.encode()]
    assert tok.decode(ids) == text
    assert [token_bytes(tok, t) for t in ids] == [bytes([b]) for b in text.encode()]


def test_draw_token_bytes_marks_tokens_and_characters_split_by_token_boundaries(tok):
    emoji = tok.encode("🌟", add_special_tokens=False)  # 4 bytes in 3 tokens
    word = tok.encode(" Croûte", add_special_tokens=False)  # û is one token: nothing split
    fig = draw_token_bytes(tok, {"emoji": emoji, "word": word})
    assert gids(fig, "split") == ["split-char"] + ["split"] * len(emoji)
    assert gids(fig, "whole") == ["whole"] * len(word)
    assert len(gids(fig, "char")) == len(" Croûte")


def test_draw_token_bytes_refuses_tokens_that_end_inside_a_character(tok):
    ids = tok.encode("🌟", add_special_tokens=False)
    with pytest.raises(ValueError, match="character boundary"):
        draw_token_bytes(tok, {"cut": ids[:-1]})


def test_draw_decode_cost_draws_both_ways_in_both_panels():
    n = np.arange(1, 101)
    frame = pd.DataFrame({"tokens": n, "full_tokens": n, "incremental_tokens": 3, "incremental_us": 5.0,
                          "full_us": np.where(n % 10 == 0, n * 0.3, np.nan)})  # fmt: skip
    fig = draw_decode_cost(frame)
    assert sorted(gids(fig, "")) == ["full", "full", "incremental", "incremental"]
    full_time = [line for line in fig.axes[1].get_lines() if line.get_gid() == "full"][0]
    assert len(full_time.get_xdata()) == 10  # only the timed steps
    assert "5,050 tokens decoded" in fig._suptitle.get_text() and "300 incrementally" in fig._suptitle.get_text()
