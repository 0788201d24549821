"""Incremental detokenization (station 9): the bytes behind byte-level BPE tokens, the UTF-8
characters they split, and what decoding costs when it is done incrementally or over the whole text
at every step.

    token_bytes(tokenizer, token_id)                 # the raw bytes one byte-level token stands for
    byte_token_ids(tokenizer)                        # byte -> its one-byte token: spell text byte by byte
    draw_token_bytes(tokenizer, {"label": ids})      # characters, bytes and tokens, one above the other
    draw_decode_cost(frame)                          # tokens decoded and time per step, two ways

The figures only draw what they are given: the token ids come from a real generation, the cost
frame from a measured run (see notebooks/15_incremental_detokenization.ipynb).
"""

from __future__ import annotations

import codecs
from functools import cache
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties, findfont
from matplotlib.ft2font import FT2Font
from matplotlib.patches import Patch, Rectangle

from labkit.viz import style

REPLACEMENT_CHAR = "\ufffd"
ASCII_BYTE = "#e9ecef"  # a byte that is a whole character
LEAD_BYTE = "#457b9d"  # the first byte of a multi-byte character (says how many follow)
CONTINUATION_BYTE = "#a8dadc"  # 10xxxxxx: a byte that continues a character
WHOLE_TOKEN = "#d8f3dc"  # a token whose bytes are whole characters: it decodes on its own
SPLIT_TOKEN = "#f28482"  # a token that starts or ends inside a character: on its own it decodes to U+FFFD
SPLIT_CHAR_EDGE = "#d62828"  # a character whose bytes lie in more than one token
FULL = "#555555"  # decoding the whole text at every step
INCREMENTAL = style.STATION_COLORS[9]  # the DetokenizerManager's window (station 9's colour)


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character a token string uses -> its byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes a byte-level BPE token stands for (SmolLM2's, GPT-2's, Llama 3's, Qwen's tokenizers).
    Each byte is spelled in the vocabulary as one printable character (space is 'Ġ'); ValueError for a
    token that is not spelled that way (a special token such as <|im_end|>, another kind of tokenizer)."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    table = _byte_decoder()
    if token_id in getattr(tokenizer, "all_special_ids", ()) or any(c not in table for c in piece):
        raise ValueError(f"token {token_id} ({piece!r}) is not a byte-level token")
    return bytes(table[c] for c in piece)


@cache
def _font_has(char: str) -> bool:
    """Whether the figures' font draws `char` (DejaVu Sans has no CJK or emoji glyphs)."""
    return FT2Font(findfont(FontProperties())).get_char_index(ord(char)) != 0


def _char_label(char: str) -> str:
    if char == " ":
        return "·"
    if char == "\n":
        return "↵"
    return char if char.isprintable() and _font_has(char) else f"U+{ord(char):04X}"


def _token_label(text: str) -> str:
    return "".join(_char_label(c) if c in " \n" or _font_has(c) else "□" for c in text)


def _title(text: str) -> str:
    """`text` with each character the font lacks written as its code point."""
    return "".join(c if _font_has(c) else f"U+{ord(c):04X}" for c in text)


def _characters(data: bytes) -> list[tuple[int, int, str]]:
    """(first byte, end byte, character) of each character of valid UTF-8 `data`, fed byte by byte
    to Python's incremental decoder: a character is out when its last byte is in."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    chars, start = [], 0
    for i in range(len(data)):
        text = decoder.decode(data[i : i + 1])
        if text:
            chars.append((start, i + 1, text))
            start = i + 1
    if start != len(data):
        raise ValueError("the tokens must end on a character boundary (their bytes end inside a character)")
    return chars


def draw_token_bytes(tokenizer: Any, examples: dict[str, list[int]], *, title: str | None = None) -> Figure:
    """One panel per example (label -> byte-level token ids that start and end on character
    boundaries), three rows over the same byte axis: the UTF-8 characters (a character whose bytes
    lie in more than one token is edged red; a glyph the font lacks shows as its code point), the
    bytes in hex (a whole ASCII character, a lead byte, a continuation byte), and the tokens over the
    bytes they stand for, labelled with what the token decodes to on its own (red: U+FFFD, because
    it starts or ends inside a character; □ is a glyph the font lacks). Token rectangles carry gid
    "whole" or "split", character rectangles "char" or "split-char"."""
    panels = []
    for label, ids in examples.items():
        spans, data = [], b""
        for t in ids:
            b = token_bytes(tokenizer, t)
            spans.append((len(data), len(data) + len(b), t))
            data += b
        panels.append((label, data, spans, _characters(data)))
    width = max(len(p[1]) for p in panels)
    fig = style.new_figure(min(1.0 + 0.62 * width, 14), 1.55 * len(panels) + 0.7)
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (label, data, spans, chars) in zip(axes, panels):
        starts = {s for s, _, _ in spans}
        for s, e, ch in chars:
            split = any(s < b < e for b in starts)
            ax.add_patch(Rectangle((s, 2), e - s, 0.9, fc="white", ec=SPLIT_CHAR_EDGE if split else "#888888",
                                   lw=2.0 if split else 0.8, gid="split-char" if split else "char"))  # fmt: skip
            ax.text((s + e) / 2, 2.45, _char_label(ch), ha="center", va="center", fontsize=9)
        for s, e, _ in chars:
            for i in range(s, e):
                color = ASCII_BYTE if e - s == 1 else LEAD_BYTE if i == s else CONTINUATION_BYTE
                ax.add_patch(Rectangle((i, 1), 1, 0.9, fc=color, ec="white", lw=1.0))
                ax.text(i + 0.5, 1.45, f"{data[i]:02x}", ha="center", va="center", fontsize=8,
                        family="monospace", color="white" if color == LEAD_BYTE else "black")  # fmt: skip
        for s, e, t in spans:
            alone = tokenizer.decode([t])
            split = REPLACEMENT_CHAR in alone
            ax.add_patch(Rectangle((s, 0), e - s, 0.9, fc=SPLIT_TOKEN if split else WHOLE_TOKEN, ec="#555555",
                                   lw=0.8, gid="split" if split else "whole"))  # fmt: skip
            ax.text((s + e) / 2, 0.58, _token_label(alone), ha="center", va="center", fontsize=9)
            ax.text((s + e) / 2, 0.2, str(t), ha="center", va="center", fontsize=6.5, color="#444444")
        ax.set_xlim(-0.1, width + 0.1)
        ax.set_ylim(-0.1, 3.0)
        ax.set_yticks([0.45, 1.45, 2.45], ["tokens", "bytes", "characters"], fontsize=8)
        ax.set_xticks([])
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
        ax.tick_params(left=False)
        ax.set_title(_title(label), loc="left", fontsize=9)
    handles = [
        Patch(fc=ASCII_BYTE, label="ASCII byte"),
        Patch(fc=LEAD_BYTE, label="lead byte"),
        Patch(fc=CONTINUATION_BYTE, label="continuation byte"),
        Patch(fc=WHOLE_TOKEN, ec="#555555", label="token of whole characters"),
        Patch(fc=SPLIT_TOKEN, ec="#555555", label="token inside a character: alone it decodes to U+FFFD"),
        Patch(fc="white", ec=SPLIT_CHAR_EDGE, lw=2.0, label="character split across tokens"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    style.figure_title(fig, title or "UTF-8 characters, their bytes, and the tokens over them", weight="normal")
    return fig


def draw_decode_cost(frame: pd.DataFrame, *, title: str | None = None) -> Figure:
    """Two panels over the tokens generated so far (`frame.tokens`, one row per step): the tokens
    the step decodes (`full_tokens`, `incremental_tokens`), and the microseconds it takes
    (`full_us`, `incremental_us`; a step left NaN was not timed). Lines carry gid "full" and
    "incremental" in each panel; the legend gives the incremental way's mean per step."""
    fig = style.new_figure(11, 3.4)
    left, right = fig.subplots(1, 2)
    inc_tokens, inc_us = frame.incremental_tokens.mean(), frame.incremental_us.mean()
    lines = (("full", FULL, "decode the whole text"), ("incremental", INCREMENTAL, "IncrementalDetokenizer.feed"))
    panels = (
        (left, "tokens", "tokens decoded in the step", f" (mean {inc_tokens:.1f})"),
        (right, "us", "µs per step", f" (mean {inc_us:.0f} µs)"),
    )
    for ax, column, ylabel, mean in panels:
        for name, color, label in lines:
            timed = frame[["tokens", f"{name}_{column}"]].dropna()
            ax.plot(timed.tokens, timed[f"{name}_{column}"], color=color, lw=1.6, gid=name,
                    label=label + (mean if name == "incremental" else ""))  # fmt: skip
        ax.set_xlabel("tokens generated so far")
        ax.set_ylabel(ylabel)
        ax.set_xlim(0, frame.tokens.max())
        ax.set_ylim(0, None)
        ax.legend(loc="upper left", fontsize=8, frameon=False)
    full, inc = frame.full_tokens.sum(), frame.incremental_tokens.sum()
    style.figure_title(
        fig,
        title
        or f"One token per step: {full:,} tokens decoded in all when the whole text is decoded at every step, "
        f"{inc:,} incrementally",
        weight="normal",
    )
    return fig


def byte_token_ids(tokenizer: Any) -> dict[int, int]:
    """Byte -> the id of the byte-level token that stands for that byte alone, for every byte the
    vocabulary has such a token for (SmolLM2's lacks a few control bytes and bytes that never occur
    in UTF-8). Spelling a text with these ids, one byte per token, splits every multi-byte character."""
    out = {}
    for byte, char in ((b, c) for c, b in _byte_decoder().items()):
        token_id = tokenizer.convert_tokens_to_ids(char)
        if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == char:
            out[byte] = token_id
    return dict(sorted(out.items()))
