"""Notebook 16's Build-it: check_block_keys passes the given answer and labkit's own block_keys (a disk
tier on the tiny random-weight model finds its blocks after a restart), and rejects key functions that
break the properties the disk tier relies on."""

from __future__ import annotations

import hashlib
import random
import re
import tempfile
import uuid
from unittest.mock import patch

import pytest

from labkit import Engine
from labkit.mem_cache.storage import block_keys
from tests.notebook_cells import run_cells

TINY = dict(model_path="tiny-llama", load_format="dummy")


@pytest.fixture(scope="module")
def notebook():
    names = {
        "hashlib": hashlib,
        "random": random,
        "tempfile": tempfile,
        "patch": patch,
        "Engine": Engine,
        "block_keys": block_keys,
    }
    return run_cells("16_memory_hierarchy", "build-keys-answer", "build-keys-check", **names)


def test_the_notebooks_answer_and_labkits_keys_pass_with_a_restarted_disk_tier(notebook):
    notebook["check_block_keys"](notebook["my_block_keys"], **TINY)
    notebook["check_block_keys"](block_keys, restart=False)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _ids(block: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in block)


def _blocks(tokens: list[int], block: int) -> list[list[int]]:
    return [tokens[i : i + block] for i in range(0, len(tokens) // block * block, block)]


def block_alone(tokens, block, namespace):
    """Each key hashes its own block only: the same block after another prefix gets the same key."""
    return [_sha(namespace.encode() + _ids(b)) for b in _blocks(tokens, block)]


def no_namespace(tokens, block, namespace):
    keys, prev = [], ""
    for b in _blocks(tokens, block):
        prev = _sha(prev.encode() + _ids(b))
        keys.append(prev)
    return keys


def partial_block_too(tokens, block, namespace):
    keys, prev = [], _sha(namespace.encode())
    for i in range(0, len(tokens), block):
        prev = _sha(prev.encode() + _ids(tokens[i : i + block]))
        keys.append(prev)
    return keys


def digits_joined(tokens, block, namespace):
    """Ids as decimal strings run together: [1, 23] and [12, 3] hash the same bytes."""
    keys, prev = [], _sha(namespace.encode())
    for b in _blocks(tokens, block):
        prev = _sha((prev + "".join(map(str, b))).encode())
        keys.append(prev)
    return keys


def python_hash(tokens, block, namespace):
    keys, prev = [], hash(namespace)
    for b in _blocks(tokens, block):
        prev = hash((prev, *b))
        keys.append(str(prev))
    return keys


def salted(tokens, block, namespace):
    """A fresh salt per call: a restarted server could never find a block again."""
    keys, prev = [], _sha((namespace + uuid.uuid4().hex).encode())
    for b in _blocks(tokens, block):
        prev = _sha(prev.encode() + _ids(b))
        keys.append(prev)
    return keys


def whole_list(tokens, block, namespace):
    """Every key hashes all the tokens: appending a block changes the keys before it."""
    everything = _sha(namespace.encode() + _ids(tokens))
    return [_sha(f"{everything}{i}".encode()) for i in range(len(tokens) // block)]


@pytest.mark.parametrize(
    ("wrong", "complaint"),
    [
        (block_alone, "not block i alone"),
        (no_namespace, "another namespace gave the same keys"),
        (partial_block_too, "a partial block gets none"),
        (digits_joined, "keep the ids apart"),
        (python_hash, "64 lowercase hex digits"),
        (salted, "the same tokens gave other keys"),
        (whole_list, "appending tokens changed the keys before them"),
    ],
)
def test_check_block_keys_rejects_keys_that_break_a_property(notebook, wrong, complaint):
    with pytest.raises(AssertionError, match=re.escape(complaint)):
        notebook["check_block_keys"](wrong, restart=False)
