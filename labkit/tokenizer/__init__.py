"""Tokenizer-side helpers: incremental detokenization."""

from labkit.tokenizer.detokenizer import DecodeStatus, IncrementalDetokenizer

__all__ = ["DecodeStatus", "IncrementalDetokenizer"]
