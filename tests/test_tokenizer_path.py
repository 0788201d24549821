"""tokenizer_path: a random-weight model borrows a tokenizer and takes text; a tokenizer that is
missing or larger than the model's vocabulary is refused before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from labkit import Engine

WORDS = ["<unk>", "hello", "world"] + [f"w{i}" for i in range(100)]  # 103 tokens; tiny-qwen3 has 256
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def word_tokenizer(directory: Path, words: list[str]) -> Path:
    """A whitespace word-level HF tokenizer of `words` (ids in list order), saved in `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0]).save_pretrained(directory)
    return directory


def test_a_random_weight_model_takes_text_with_a_borrowed_tokenizer(tmp_path):
    path = word_tokenizer(tmp_path, WORDS)
    engine = Engine(model_path="tiny-qwen3", load_format="dummy", tokenizer_path=str(path), device="cpu")
    out = engine.generate("hello world w7", sampling_params=GREEDY)
    assert out["meta_info"]["prompt_tokens"] == 3
    same = engine.generate(input_ids=[1, 2, 10], sampling_params=GREEDY)  # the words' ids
    assert out["output_ids"] == same["output_ids"] and len(out["output_ids"]) == 4
    assert out["text"] == engine.tokenizer.decode(out["output_ids"])


def test_without_a_tokenizer_text_is_refused_naming_the_option():
    engine = Engine(model_path="tiny-qwen3", load_format="dummy", device="cpu")
    with pytest.raises(ValueError, match="tokenizer_path"):
        engine.generate("hello", sampling_params=GREEDY)


def test_a_missing_or_too_large_tokenizer_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory with a tokenizer"):
        Engine(model_path="tiny-qwen3", load_format="dummy", tokenizer_path=str(tmp_path / "none"))
    big = word_tokenizer(tmp_path, WORDS + [f"x{i}" for i in range(200)])
    with pytest.raises(ValueError, match="303 tokens do not fit the model's vocabulary of 256"):
        Engine(model_path="tiny-qwen3", load_format="dummy", tokenizer_path=str(big))
