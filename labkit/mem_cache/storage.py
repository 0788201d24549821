"""The disk tier under HiRadixCache's host pool: KV blocks of `block` tokens, each keyed by the hash
of the whole token prefix up to its end (block_keys), so a restarted server finds its prefixes again.
A namespace string names the model and KV layout; blocks of one namespace are never read by another."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

_HEX_DIGITS = frozenset("0123456789abcdef")


def _token_ids(tokens: Sequence[int]) -> np.ndarray:
    try:
        return np.asarray(tokens, dtype=np.int32)
    except OverflowError as e:
        raise ValueError(f"token ids must fit in int32: {e}") from e


def _namespace_digest(namespace: str) -> str:
    if not namespace:
        raise ValueError("the storage namespace must name the model and KV layout, got an empty string")
    return hashlib.sha256(namespace.encode()).hexdigest()


def block_keys(tokens: Sequence[int], block: int, namespace: str) -> list[str]:
    """One key per full block of `block` tokens (a trailing partial block gets none). Key i is the
    sha256 hex of key i-1 (sha256(namespace) for i = 0) and block i's token ids, so it names the whole
    prefix up to the end of its block: equal prefixes give equal keys, any earlier change changes it."""
    if block <= 0:
        raise ValueError(f"the storage block must be a positive number of tokens, got {block}")
    num_blocks = len(tokens) // block
    # Little-endian int32 bytes: the keys name files on disk, so they must not depend on the machine.
    ids = _token_ids(tokens[: num_blocks * block]).astype("<i4", copy=False).tobytes()
    step = block * 4
    keys, prev = [], _namespace_digest(namespace)
    for i in range(num_blocks):
        prev = hashlib.sha256(prev.encode() + ids[i * step : (i + 1) * step]).hexdigest()
        keys.append(prev)
    return keys


def _layout_error(k: torch.Tensor, v: torch.Tensor, num_tokens: int) -> str | None:
    if k.dim() == 4 and k.shape == v.shape and k.dtype == v.dtype and k.shape[1] == num_tokens:
        return None
    return (
        f"k and v must both be [num_layers, {num_tokens}, num_kv_heads, head_dim] of one dtype, got "
        f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
    )


def _checksum(k: torch.Tensor, v: torch.Tensor) -> int:
    # torch.load checks no checksum: a flipped byte in the tensor data would load as wrong KV. The
    # layout is hashed too, so a corrupt dtype or shape in the pickle is caught as well.
    crc = zlib.crc32(f"{k.dtype} {tuple(k.shape)}".encode())
    for t in (k, v):
        crc = zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy().data, crc)
    return crc


def _block_error(blob: object, ids: torch.Tensor) -> str | None:
    """Why a loaded file is not the block of `ids`, or None when it is."""
    if not (
        isinstance(blob, dict)
        and all(isinstance(blob.get(name), torch.Tensor) for name in ("tokens", "k", "v"))
        and isinstance(blob.get("crc"), int)
    ):
        return "not a KV block file"
    k, v, stored = blob["k"], blob["v"], blob["tokens"]
    if stored.dtype != torch.int32 or not torch.equal(stored, ids):
        return f"stored for other tokens than the {len(ids)} asked for"
    problem = _layout_error(k, v, len(ids))
    if problem is None and _checksum(k, v) != blob["crc"]:
        problem = "checksum mismatch"
    return problem


@dataclass
class StorageStats:
    """Counters since construction. A read of an absent key is a miss: it counts in `reads` only."""

    reads: int = 0
    read_hits: int = 0
    read_failures: int = 0
    writes: int = 0
    write_failures: int = 0


class HiCacheStorage(ABC):
    """A store of KV blocks keyed by block_keys(). Guarantees: get() returns either exactly what set()
    stored under that key for those tokens, or None; any failure (missing, unreadable, corrupt,
    truncated, tokens that differ from the ones stored) is None, never an exception and never wrong
    KV; set() returns False instead of raising when the write fails, and never leaves a partial
    block that get() would return. Keys, tokens or tensors that no correct caller passes (a key not
    made by block_keys, token ids beyond int32, k and v of another shape) raise ValueError.

    Backends share the constructor (root: where the blocks live, namespace: the model and KV layout),
    so STORAGE_BACKENDS[name](root, namespace) builds any of them."""

    def __init__(self, root: str | Path, namespace: str):
        self.namespace = namespace
        self.stats = StorageStats()

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a block is stored under `key` (without reading it; get() may still fail on it)."""

    @abstractmethod
    def get(self, key: str, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k, v) on the CPU, each [num_layers, block, num_kv_heads, head_dim] in the stored dtype."""

    @abstractmethod
    def set(self, key: str, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> bool:
        """Store k and v (any device) for the block `tokens` under `key`, replacing what was there."""

    @abstractmethod
    def summary(self) -> dict[str, object]:
        """What the store holds and its stats, e.g. {"backend": "file", "blocks": n, "MiB": x, ...}."""


class HiCacheFile(HiCacheStorage):
    """One torch.save file per block: root/<sha256(namespace)[:16]>/<key[:2]>/<key>.pt, holding the
    block's token ids, k, v and a checksum. Writes go to a temp file in the same folder, then
    os.replace: readers, this process or another, see the old block or the new one, never a part."""

    def __init__(self, root: str | Path, namespace: str):
        super().__init__(root, namespace)
        self.dir = Path(root) / _namespace_digest(namespace)[:16]
        self._bad: set[Path] = set()  # files that failed a read: logged once, and exists() says False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(suffix=".probe", dir=self.dir)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as e:
            raise ValueError(f"--hicache-storage-dir {root}: not writable ({type(e).__name__}: {e})") from e

    def _path(self, key: str) -> Path:
        if len(key) != 64 or not set(key) <= _HEX_DIGITS:
            raise ValueError(f"not a storage key (64 lowercase hex digits from block_keys): {key!r}")
        return self.dir / key[:2] / f"{key}.pt"

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return path not in self._bad and os.path.isfile(path)

    def get(self, key: str, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        path, ids = self._path(key), torch.from_numpy(_token_ids(tokens))
        self.stats.reads += 1
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            problem = _block_error(blob, ids)
        except FileNotFoundError:
            return None
        # A bad file raises anything from pickle, zipfile, EOF or torch (a sparse k, say, in the checks).
        except Exception as e:
            problem = f"unreadable ({type(e).__name__}: {e})"
        if problem is not None:
            self.stats.read_failures += 1
            if path not in self._bad:
                self._bad.add(path)
                logger.warning("hicache storage: ignoring %s: %s", path, problem)
            return None
        self.stats.read_hits += 1
        self._bad.discard(path)  # another writer replaced a bad file with a good one
        return blob["k"], blob["v"]

    def set(self, key: str, tokens: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> bool:
        path, ids = self._path(key), _token_ids(tokens)
        problem = _layout_error(k, v, len(ids))
        if problem is not None:
            raise ValueError(problem)
        # Fresh contiguous CPU copies: torch.save writes a view's whole storage (for a block sliced
        # out of a KV pool, the whole pool).
        k, v = (t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True) for t in (k, v))
        blob = {"tokens": torch.from_numpy(ids), "k": k, "v": v, "crc": _checksum(k, v)}
        self.stats.writes += 1
        tmp = None
        try:
            # Not parents=True: if the namespace folder was removed, the tier was cleared on purpose.
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                torch.save(blob, f)
            # No fsync: after a crash the file may be empty or truncated, which get() reads as None.
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:  # torch's zip writer reports a failed write as RuntimeError
            self.stats.write_failures += 1
            if self.stats.write_failures == 1:
                logger.warning(
                    "hicache storage: writing %s failed (%s: %s); later failures are only counted",
                    path,
                    type(e).__name__,
                    e,
                )
            if tmp is not None:
                with suppress(OSError):
                    os.unlink(tmp)
            return False
        self._bad.discard(path)
        return True

    def summary(self) -> dict[str, object]:
        sizes = [p.stat().st_size for p in self.dir.glob("*/*.pt")]
        return {
            "backend": "file",
            "dir": str(self.dir),
            "blocks": len(sizes),
            "MiB": round(sum(sizes) / 2**20, 2),
            **asdict(self.stats),
        }


STORAGE_BACKENDS: dict[str, type[HiCacheStorage]] = {"file": HiCacheFile}
