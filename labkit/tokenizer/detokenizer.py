"""Incremental detokenization with stop strings: the DetokenizerManager's per-request logic.

Two hazards make "decode each new token on its own" wrong:

* byte-level tokens can split one UTF-8 character (Chinese, emoji) across tokens; decoding a prefix
  then yields U+FFFD, so text is only confirmed once its decode no longer ends in U+FFFD;
* a stop string can arrive split across pieces, so any tail that could begin a stop string is held
  back until it either completes (and is cut) or diverges (and is emitted).

Decoding is windowed: only ``decode_ids[surr_offset:]`` is decoded each step, and the new text is what
that window adds over ``decode_ids[surr_offset:read_offset]`` (the preceding tokens give context).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DecodeStatus:
    """Per-request detokenization state (SGLang's vocabulary).

    ``decode_ids[:read_offset]`` is confirmed as ``decoded_text``; ``decode_ids[surr_offset:read_offset]``
    is the context window re-decoded with the next tokens; ``decoded_text[:sent_offset]`` has been emitted.
    """

    decoded_text: str = ""
    decode_ids: list[int] = field(default_factory=list)
    surr_offset: int = 0
    read_offset: int = 0
    sent_offset: int = 0


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The stop string that completes first in ``text[start:]`` as (start index, stop), or None.

    "First" means the earliest end position (ties: the longest, i.e. earliest start), which is what a
    stream sees first, so the result does not depend on how the text was chunked.
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return None if best is None else (best[1], best[2])


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class TokenDecoder:
    """tokenizer.decode(token_ids, ...), and a tokenizer where only decode is asked of one (the
    scheduler's stop strings). A fast tokenizer whose decode adds no Python post-processing (no
    clean_up_tokenization_spaces) decodes through its Rust tokenizer directly: transformers'
    wrapper costs several times the decode itself, and a decode step decodes twice per request to
    detokenize (a step of 16 requests with the embedded tokenizer, on the 2-core machine: 101 us
    through the wrapper, 45 us without; benchmarks/test_bench_detokenizer.py), once more per request
    with stop strings (Req.check_finished)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self.backend = backend if plain and hasattr(backend, "decode") else None

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True
    ) -> str:
        if self.backend is not None:  # a fast tokenizer ignores spaces_between_special_tokens
            return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that are safe to send.

    The pieces from every :meth:`feed` plus :meth:`finish` concatenate to
    ``tokenizer.decode(all_ids, skip_special_tokens=...)`` cut before the first stop string (see
    :func:`find_stop`). After a stop string matches, :attr:`matched_stop` is set and feeds return "".
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.decoder = TokenDecoder(tokenizer)
        self.stop = [stop] if isinstance(stop, str) else list(stop)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.status = DecodeStatus()
        self.matched_stop: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self.status.decoded_text[: self.status.sent_offset]

    def feed(self, new_ids: Sequence[int]) -> str:
        """Add generated token ids; return the new text that is safe to emit now (maybe "")."""
        if self.finished:
            raise RuntimeError("feed() after finish()")
        if self.matched_stop is not None:
            return ""
        self.status.decode_ids.extend(new_ids)
        new_text = self._window_text()
        if new_text and not new_text.endswith(REPLACEMENT_CHAR):
            self._confirm(new_text)
        return self._emit(final=False)

    def finish(self) -> str:
        """Flush everything still held back (incomplete characters decode as U+FFFD; a partial stop
        string that never completed is real text) and return the last piece."""
        if self.finished:
            return ""
        self.finished = True
        if self.matched_stop is not None:
            return ""
        if self.status.read_offset < len(self.status.decode_ids):
            self._confirm(self._window_text())
        return self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.decoder.decode(ids, self.skip_special_tokens, self.spaces_between_special_tokens)

    def _window_text(self) -> str:
        """Text the unread tokens add, decoded with the previous chunk as context."""
        st = self.status
        prefix = self._decode(st.decode_ids[st.surr_offset : st.read_offset])
        return self._decode(st.decode_ids[st.surr_offset :])[len(prefix) :]

    def _confirm(self, new_text: str) -> None:
        st = self.status
        st.decoded_text += new_text
        st.surr_offset = st.read_offset
        st.read_offset = len(st.decode_ids)

    def _emit(self, final: bool) -> str:
        """Advance ``sent_offset`` over confirmed text, cutting at a stop string or holding back a
        possible stop-string prefix (unless ``final``)."""
        st = self.status
        # Nothing before sent_offset can start a stop string: such a tail would have been held back.
        hit = find_stop(st.decoded_text, self.stop, st.sent_offset)
        if hit is not None:
            idx, self.matched_stop = hit
            st.decoded_text = st.decoded_text[:idx]
            end = idx
        elif final:
            end = len(st.decoded_text)
        else:
            end = len(st.decoded_text) - partial_stop_len(st.decoded_text[st.sent_offset :], self.stop)
        piece = st.decoded_text[st.sent_offset : end]
        st.sent_offset = end
        return piece
