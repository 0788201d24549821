"""The disk tier under HiRadixCache's host pool: KV blocks of `block` tokens, each keyed by the hash
of the whole token prefix up to its end (block_keys), so a restarted server finds its prefixes again.
A namespace string names the model and KV layout; blocks of one namespace are never read by another.
An optional size cap (--hicache-storage-size) keeps the directory bounded, evicting the least
recently used blocks."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from labkit.mem_cache.memory_pool import is_positive_finite

logger = logging.getLogger(__name__)

_HEX_DIGITS = frozenset("0123456789abcdef")
GIB = 1 << 30
# Under the root: <namespace digest>/<key[:2]>/ holds the blocks <key>.pt and set()'s temp files
# .<key>.<random>.tmp; nothing else there is ever touched.
_NAMESPACE_DIR = re.compile(r"[0-9a-f]{16}")
_BLOCK_PATH = re.compile(r"[0-9a-f]{16}/([0-9a-f]{2})/\1[0-9a-f]{62}\.pt")
_TEMP_PATH = re.compile(r"[0-9a-f]{16}/([0-9a-f]{2})/\.\1[0-9a-f]{62}\.[^/]+\.tmp")
# A temp file older than this is left by a killed writer (a block's write takes well under a second);
# a younger one may be another live process's write in progress.
STALE_TEMP_S = 60.0


def cap_bytes(size_gib: object) -> int | None:
    """--hicache-storage-size (GiB) in bytes; None stays None (unbounded). ValueError unless a
    positive finite number."""
    if size_gib is None:
        return None
    if not is_positive_finite(size_gib):
        raise ValueError(
            f"--hicache-storage-size must be a positive number of GiB (or none: unbounded), got {size_gib!r}"
        )
    return int(size_gib * GIB)


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
    """Counters since construction. A read of an absent key is a miss: it counts in `reads` only.
    `too_large`: writes not done because the block alone exceeds the size cap; `evictions`: blocks
    removed to stay under it."""

    reads: int = 0
    read_hits: int = 0
    read_failures: int = 0
    writes: int = 0
    write_failures: int = 0
    too_large: int = 0
    evictions: int = 0


class HiCacheStorage(ABC):
    """A store of KV blocks keyed by block_keys(). Guarantees: get() returns either exactly what set()
    stored under that key for those tokens, or None; any failure (missing, unreadable, corrupt,
    truncated, tokens that differ from the ones stored) is None, never an exception and never wrong
    KV; set() returns False instead of raising when the write fails, and never leaves a partial
    block that get() would return. Keys, tokens or tensors that no correct caller passes (a key not
    made by block_keys, token ids beyond int32, k and v of another shape) raise ValueError.

    Backends share the constructor (root: where the blocks live, namespace: the model and KV layout,
    size_gib: the most GiB the store may hold, None for no limit; ValueError for a size that is not a
    positive number), so STORAGE_BACKENDS[name](root, namespace, size_gib) builds any of them. A
    bounded store drops blocks to stay under its size (a later get() of them is a miss) and does
    not store a block bigger than it (set() returns False)."""

    def __init__(self, root: str | Path, namespace: str, size_gib: float | None = None):
        self.namespace = namespace
        self.max_bytes = cap_bytes(size_gib)
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
    os.replace: readers, this process or another, see the old block or the new one, never a part.

    The size cap covers the blocks of every namespace under the root. An in-memory LRU of them
    (oldest first), built from the files' mtimes at start, orders eviction; a write or a read
    sets the file's mtime, so a restart keeps the order. Eviction costs O(1) per block. The start
    also removes temp files that a killed writer left. The cap holds for what this process knows:
    the blocks there at its start and those it wrote or read since; another process writing to the
    same root at the same time is not counted."""

    def __init__(self, root: str | Path, namespace: str, size_gib: float | None = None):
        super().__init__(root, namespace, size_gib)
        self.root = Path(root)
        self.dir = self.root / _namespace_digest(namespace)[:16]
        self._bad: set[Path] = set()  # files that failed a read: logged once, and exists() says False
        self._lru: OrderedDict[Path, int] = OrderedDict()  # block file -> bytes, least recently used first
        self._bytes = 0  # sum of self._lru's values
        self._last_mtime_ns = 0  # the newest mtime set or seen: the LRU's clock
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
        self._load_lru()

    def _load_lru(self) -> None:
        """Remove stale temp files, fill the LRU from the block files' mtimes, evict down to the cap."""
        blocks, removed, stale_before = [], 0, time.time() - STALE_TEMP_S
        namespaces = [d for d in self.root.iterdir() if _NAMESPACE_DIR.fullmatch(d.name)]
        for path in (p for d in namespaces for p in d.glob("*/*")):
            rel = path.relative_to(self.root).as_posix()
            try:
                if _BLOCK_PATH.fullmatch(rel):
                    st = path.stat()
                    blocks.append((st.st_mtime_ns, path, st.st_size))
                elif _TEMP_PATH.fullmatch(rel) and path.stat().st_mtime < stale_before:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # removed meanwhile by another process
                continue
        for mtime_ns, path, size in sorted(blocks):
            self._track(path, size)
            self._last_mtime_ns = mtime_ns
        self._fit()
        logger.info(
            "hicache storage %s: %d blocks, %.2f GiB of %s; removed %d stale temp files, evicted %d blocks",
            self.root,
            len(self._lru),
            self._bytes / GIB,
            "unbounded" if self.max_bytes is None else f"{self.max_bytes / GIB:.2f} GiB",
            removed,
            self.stats.evictions,
        )

    def _track(self, path: Path, size: int) -> None:
        """Record block `path` of `size` bytes as the most recently used."""
        self._bytes += size - self._lru.pop(path, 0)
        self._lru[path] = size

    def _touch(self, path: Path) -> None:
        """Set the file's mtime past every earlier one (the clock's ticks can be coarser than a write)."""
        self._last_mtime_ns = max(time.time_ns(), self._last_mtime_ns + 1)
        with suppress(OSError):  # only the order after a restart depends on it
            os.utime(path, ns=(self._last_mtime_ns, self._last_mtime_ns))

    def _fit(self, keep: Path | None = None) -> None:
        """Evict least recently used blocks, `keep` last, until the tracked bytes are within the cap."""
        while self.max_bytes is not None and self._bytes > self.max_bytes:
            oldest = iter(self._lru)
            victim = next(oldest)
            if victim == keep:
                victim = next(oldest, victim)
            self._bytes -= self._lru.pop(victim)
            self._bad.discard(victim)
            self.stats.evictions += 1
            try:
                victim.unlink()
            except FileNotFoundError:
                pass  # already removed by another process
            except OSError as e:
                logger.warning("hicache storage: cannot evict %s (%s: %s)", victim, type(e).__name__, e)

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
        if path in self._lru:
            self._lru.move_to_end(path)
        else:  # written by another process since this one started
            with suppress(OSError):
                self._track(path, path.stat().st_size)
                self._fit(keep=path)
        self._touch(path)
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
            size = os.stat(tmp).st_size
            if self.max_bytes is not None and size > self.max_bytes:
                os.unlink(tmp)
                self.stats.too_large += 1
                if self.stats.too_large == 1:
                    logger.warning(
                        "hicache storage: a block of %d bytes exceeds --hicache-storage-size (%d bytes); such "
                        "blocks are not stored",
                        size,
                        self.max_bytes,
                    )
                return False
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
        self._track(path, size)
        self._touch(path)
        self._fit(keep=path)
        return True

    def summary(self) -> dict[str, object]:
        """Blocks and MiB of this namespace (on disk now); root_MiB: the blocks of every namespace
        under the root that the size cap counts; cap_MiB: the cap (None: unbounded)."""
        sizes = [p.stat().st_size for p in self.dir.glob("*/*.pt")]
        return {
            "backend": "file",
            "dir": str(self.dir),
            "blocks": len(sizes),
            "MiB": round(sum(sizes) / 2**20, 2),
            "root_MiB": round(self._bytes / 2**20, 2),
            "cap_MiB": None if self.max_bytes is None else round(self.max_bytes / 2**20, 2),
            **asdict(self.stats),
        }


STORAGE_BACKENDS: dict[str, type[HiCacheStorage]] = {"file": HiCacheFile}
