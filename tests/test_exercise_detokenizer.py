"""The "Build it" check of notebooks/15_incremental_detokenization.ipynb: `check_detokenizer` passes
the notebook's answer and fails wrong incremental detokenizers, each for its own reason. The check,
the answer and the SentencePiece-style tokenizer are taken from the notebook's own cells (their
imports and top-level definitions only), so the test follows the notebook as it is edited."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "15_incremental_detokenization.ipynb"
DEFINITIONS = (
    *("FFFD", "MAX_DECODED_PER_STEP", "PIECES", "random_text", "stream_through", "check_detokenizer"),
    *("detokenize_step", "sentencepiece_style_tokenizer"),
)
# Stand-ins for the notebook's generations: texts whose tokens split characters, and plain English.
TEXTS = [
    'In Chinese, "おく" is a polite phrase that means "thank you".',
    "🌟🌟🌟 Have a wonderful day! 👍🏽",
    "Идеальное, Вас жудобра. Καληνύχτα!",
    "The waves of the sea, a silent beauty,\nA gentle lapping of the shore.",
]


def notebook_definitions(names: tuple[str, ...]) -> dict:
    """Run the notebook's import statements and its top-level definitions of `names` (functions and
    assignments) in a fresh namespace; nothing else of the notebook runs."""
    namespace: dict = {}
    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        keep = [
            node
            for node in ast.parse("".join(cell["source"])).body
            if isinstance(node, (ast.Import, ast.ImportFrom))
            or (isinstance(node, ast.FunctionDef) and node.name in names)
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) in names for t in node.targets))
        ]
        exec(compile(ast.Module(body=keep, type_ignores=[]), str(NOTEBOOK), "exec"), namespace)
    missing = set(names) - set(namespace)
    assert not missing, f"the notebook no longer defines {sorted(missing)}"
    return namespace


@pytest.fixture(scope="module")
def nb():
    return notebook_definitions(DEFINITIONS)


@pytest.fixture(scope="module")
def setup(nb, embedded_dir):
    from labkit.model_loader import load_tokenizer

    tok = load_tokenizer(embedded_dir)
    generations = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in TEXTS]
    return tok, generations, nb["sentencepiece_style_tokenizer"](TEXTS)


def check(nb, setup, step):
    tok, generations, spaced = setup
    nb["check_detokenizer"](step, tok, generations, spaced, n_random=20, seed=0)


def test_check_detokenizer_accepts_the_notebooks_answer(nb, setup, capsys):
    check(nb, setup, nb["detokenize_step"])
    assert "the stream is right" in capsys.readouterr().out


def only_the_new_tokens(decode, ids, surr_offset, read_offset):
    return decode(ids[read_offset:]), read_offset, len(ids)


def whole_text_difference(decode, ids, surr_offset, read_offset):
    return decode(ids)[len(decode(ids[:read_offset])) :], 0, len(ids)


def whole_text_holding_incomplete_characters(decode, ids, surr_offset, read_offset):
    new = decode(ids)[len(decode(ids[:read_offset])) :]
    return ("", 0, read_offset) if not new or new.endswith("\ufffd") else (new, 0, len(ids))


def no_context(decode, ids, surr_offset, read_offset):
    new = decode(ids[read_offset:])
    return ("", read_offset, read_offset) if not new or new.endswith("\ufffd") else (new, len(ids), len(ids))


def holds_everything(decode, ids, surr_offset, read_offset):
    return "", 0, 0


def offsets_past_the_end(decode, ids, surr_offset, read_offset):
    return decode(ids[read_offset:]), len(ids), len(ids) + 1


WRONG_STEPS = [
    (only_the_new_tokens, "ends inside a character"),
    (whole_text_difference, "ends inside a character"),
    (whole_text_holding_incomplete_characters, "decode a window, not the whole text"),
    (no_context, "cannot be taken back"),  # right for byte-level BPE; the SentencePiece style loses spaces
    (holds_everything, "though it is complete"),
    (offsets_past_the_end, "offsets"),
]


@pytest.mark.parametrize(("wrong", "reason"), [pytest.param(f, r, id=f.__name__) for f, r in WRONG_STEPS])
def test_check_detokenizer_rejects_a_wrong_step(nb, setup, wrong, reason):
    with pytest.raises(AssertionError, match=reason):
        check(nb, setup, wrong)


def test_no_context_is_right_for_byte_level_bpe_alone(nb, setup):
    """The SentencePiece-style sentences are what catch a step without context: without them the
    check passes it (SmolLM2's tokens carry their own spaces)."""
    tok, generations, _ = setup
    nb["check_detokenizer"](no_context, tok, generations, tok, n_random=0, seed=0)


def test_byte_by_byte_spelling_splits_every_multibyte_character(nb, setup):
    from labkit.viz.detokenize import byte_token_ids

    tok = setup[0]
    byte_ids = byte_token_ids(tok)
    for seed in range(20):
        text = nb["random_text"](random.Random(seed))
        ids = [byte_ids[b] for b in text.encode()]
        assert tok.decode(ids) == text
        assert all(("\ufffd" in tok.decode([i])) == (b >= 0x80) for i, b in zip(ids, text.encode()))
