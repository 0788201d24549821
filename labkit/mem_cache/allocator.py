"""TokenToKVPoolAllocator: hands out KV slots of the TokenToKVPool in whole pages.

Page p covers slots p*P .. p*P+P-1 (P = page_size; 1 = token granular). Page 0 is reserved (padded
tokens write there), so pages 1..size//P are the usable ones. A request's positions fill its pages in
order: position j sits in the slot after position j-1 when j % P != 0, and at the first slot of a
fresh page when j % P == 0. Attention kernels rely on that layout to address KV page by page.
"""

from __future__ import annotations

import torch

from labkit.reprs import Summarized


class TokenToKVPoolAllocator(Summarized):
    """Free list of KV pages, kept as tensors: alloc slices the head of the list; free appends the
    freed pages as a new chunk, merged into the head only when the head runs short (amortized O(1)
    per page, where concatenating on every free would copy the whole list each time).

    Guarantees: a page is never handed out twice before it is freed; alloc_* either allocates
    everything asked for or nothing (returns None); freeing a page that is already free raises
    RuntimeError (checked with a per-page flag, O(freed pages), never O(pool size)).
    """

    def __init__(self, size: int, page_size: int, device: torch.device | str = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < 0 or size % page_size:
            raise ValueError(f"size {size} must be a non-negative multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.device = torch.device(device)
        self.num_pages = size // page_size
        self.clear()

    def clear(self) -> None:
        """Make every usable page free again."""
        self._head = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._released: list[torch.Tensor] = []  # freed since the last merge into _head
        self._num_free = self.num_pages
        # is_free[p] mirrors membership of p in the free list; index 0 (reserved page) stays False.
        self._is_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._is_free[0] = False

    @property
    def free_pages(self) -> torch.Tensor:
        """The free page numbers (a copy; order unspecified)."""
        return torch.cat([self._head, *self._released])

    def summary(self) -> dict[str, object]:
        return {"size": self.size, "free": self.available_size(), "page_size": self.page_size}

    def available_size(self) -> int:
        """Free slots (free pages * page_size)."""
        return self._num_free * self.page_size

    def _take(self, n: int) -> torch.Tensor:
        """n free pages; the caller has checked n <= _num_free."""
        if n > self._head.numel():
            self._head = torch.cat([self._head, *self._released])
            self._released = []
        pages, self._head = self._head[:n], self._head[n:]
        self._num_free -= n
        self._is_free.index_fill_(0, pages, False)
        return pages

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """Slots for positions prefix_lens[i]..seq_lens[i]-1 of each request, concatenated in request
        order (int64). last_locs[i] is the slot of position prefix_lens[i]-1; it is read only when
        prefix_lens[i] % page_size != 0 (the request's last page still has room). None, with nothing
        allocated, when there are not enough free pages."""
        n = len(seq_lens)
        if len(prefix_lens) != n or len(last_locs) != n:
            raise ValueError("prefix_lens, seq_lens and last_locs must have the same length")
        if any(s < p for p, s in zip(prefix_lens, seq_lens)):
            raise ValueError("seq_len < prefix_len")
        P = self.page_size
        if P == 1:
            need = sum(seq_lens) - sum(prefix_lens)
            if need > self._num_free:
                return None
            return self._take(need)

        # Pages needed per request: ceil(seq/P) - ceil(prefix/P).
        new_pages = [-(-s // P) + (p // -P) for p, s in zip(prefix_lens, seq_lens)]
        need = sum(new_pages)
        if need > self._num_free:
            return None
        taken = self._take(need)
        total = sum(seq_lens) - sum(prefix_lens)
        if total == 0:
            return taken  # empty

        # Vectorized layout, per output token: pos is its position; positions below `opens` (the
        # request's first position that needs a new page) continue after last_loc, the others go to
        # page number `first_page + (pos - opens) // P` of `taken`, at offset pos % P.
        ext = [s - p for p, s in zip(prefix_lens, seq_lens)]
        meta = []
        start = first_page = 0
        for p, e, last, k in zip(prefix_lens, ext, last_locs, new_pages):
            opens = -(-p // P) * P
            meta.append((p - start, opens, last - p + 1, first_page - opens // P))
            start += e
            first_page += k
        per_tok = torch.repeat_interleave(
            torch.tensor(meta, dtype=torch.int64, device=self.device),
            torch.tensor(ext, device=self.device),
            dim=0,
            output_size=total,
        )
        pos = torch.arange(total, device=self.device) + per_tok[:, 0]
        out = pos + per_tok[:, 2]
        if need:
            page = (per_tok[:, 3] + pos.div(P, rounding_mode="floor")).clamp_(min=0)
            out = torch.where(pos < per_tok[:, 1], out, taken.index_select(0, page) * P + pos % P)
        return out

    def alloc_decode(self, seq_lens: list[int], last_locs: list[int]) -> torch.Tensor | None:
        """One slot per request for position seq_lens[i]-1 (seq_lens count the new token);
        last_locs[i] is the slot of position seq_lens[i]-2. None when out of pages."""
        if len(seq_lens) != len(last_locs):
            raise ValueError("seq_lens and last_locs must have the same length")
        P = self.page_size
        if P == 1:
            if len(seq_lens) > self._num_free:
                return None
            return self._take(len(seq_lens))
        opens = [(s - 1) % P == 0 for s in seq_lens]
        need = sum(opens)
        if need > self._num_free:
            return None
        out = torch.tensor(last_locs, dtype=torch.int64, device=self.device) + 1
        if need:
            mask = torch.tensor(opens, dtype=torch.bool, device=self.device)
            out.masked_scatter_(mask, self._take(need) * P)
        return out

    def free(self, indices: torch.Tensor) -> None:
        """Return the pages holding these slots (every slot of such a page becomes free). Raises
        RuntimeError, freeing nothing, if a page is already free or is not a usable page."""
        if indices.numel() == 0:
            return
        slots = indices.to(self.device, torch.int64).flatten()
        if self.page_size == 1:
            pages = torch.unique(slots)
            if pages.numel() != slots.numel():
                raise RuntimeError("double free: a slot is listed twice")
        else:
            pages = torch.unique(slots // self.page_size)
        lo, hi = torch.aminmax(pages)
        if int(lo) < 1 or int(hi) > self.num_pages:
            raise RuntimeError("freeing a slot outside the usable pages")
        if bool(self._is_free.index_select(0, pages).any()):
            raise RuntimeError("double free: page already free")
        self._is_free.index_fill_(0, pages, True)
        self._released.append(pages)
        self._num_free += pages.numel()
