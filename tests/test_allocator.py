"""TokenToKVPoolAllocator: page layout, exclusivity, all-or-nothing, double free."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from labkit.mem_cache.allocator import TokenToKVPoolAllocator


def test_size_must_be_page_multiple() -> None:
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(10, 4)
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(8, 0)


def test_reserved_page_never_handed_out() -> None:
    a = TokenToKVPoolAllocator(16, 4)
    assert sorted(a.free_pages.tolist()) == [1, 2, 3, 4]
    out = a.alloc_extend([0], [16], [-1])
    assert out is not None and int(out.min()) >= 4 and a.available_size() == 0
    assert sorted(out.tolist()) == list(range(4, 20))


def test_extend_continues_partial_page() -> None:
    a = TokenToKVPoolAllocator(32, 4)
    first = a.alloc_extend([0], [6], [-1])
    assert first is not None
    more = a.alloc_extend([6], [11], [int(first[-1])])
    assert more is not None
    assert more[:2].tolist() == [int(first[-1]) + 1, int(first[-1]) + 2]  # positions 6, 7
    assert int(more[2]) % 4 == 0 and more[2:].tolist() == list(range(int(more[2]), int(more[2]) + 3))
    assert a.available_size() == 32 - 12  # 3 pages


def test_decode_opens_page_only_on_boundary() -> None:
    a = TokenToKVPoolAllocator(32, 4)
    out = a.alloc_extend([0], [4], [-1])
    assert out is not None
    before = a.available_size()
    d = a.alloc_decode([5], [int(out[-1])])  # position 4: a fresh page
    assert d is not None and int(d[0]) % 4 == 0 and a.available_size() == before - 4
    d2 = a.alloc_decode([6], [int(d[0])])  # position 5: next slot, no page
    assert d2 is not None and int(d2[0]) == int(d[0]) + 1 and a.available_size() == before - 4


def test_all_or_nothing() -> None:
    a = TokenToKVPoolAllocator(8, 4)
    assert a.alloc_extend([0, 0], [4, 5], [-1, -1]) is None
    assert a.available_size() == 8
    assert a.alloc_decode([1, 1, 1], [-1, -1, -1]) is None
    assert a.available_size() == 8


def test_double_free_raises() -> None:
    for page in (1, 4):
        a = TokenToKVPoolAllocator(16, page)
        out = a.alloc_extend([0], [page], [-1])
        assert out is not None
        a.free(out)
        with pytest.raises(RuntimeError):
            a.free(out)
        with pytest.raises(RuntimeError):
            a.free(torch.tensor([0]))  # the reserved page
    a = TokenToKVPoolAllocator(16, 1)
    out = a.alloc_decode([1], [-1])
    assert out is not None
    with pytest.raises(RuntimeError):
        a.free(torch.cat((out, out)))
    assert a.available_size() == 15


def test_free_returns_whole_pages_and_clear() -> None:
    a = TokenToKVPoolAllocator(16, 4)
    out = a.alloc_extend([0], [6], [-1])
    assert out is not None
    a.free(out[5:])  # one slot of the second page frees that page
    assert a.available_size() == 12
    a.clear()
    assert a.available_size() == 16


class AllocatorMachine(RuleBasedStateMachine):
    """Sequences grow by extends and decodes and are freed; a shadow owner map checks exclusivity."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc: TokenToKVPoolAllocator | None = None
        self.seqs: list[list[int]] = []  # live sequences: their slots by position

    @precondition(lambda self: self.alloc is None)
    @rule(page=st.sampled_from([1, 4, 16]), pages=st.integers(1, 12))
    def init(self, page: int, pages: int) -> None:
        self.alloc = TokenToKVPoolAllocator(page * pages, page)

    def _check_new(self, seqs: list[list[int]], starts: list[int], out: list[int]) -> None:
        assert self.alloc is not None
        P = self.alloc.page_size
        held = {s for seq in self.seqs for s in seq}
        assert not held & set(out), "slot handed out twice"
        assert len(set(out)) == len(out)
        k = 0
        for seq, start in zip(seqs, starts):
            for j in range(start, len(seq)):
                seq[j] = out[k]
                k += 1
                if j % P:
                    assert seq[j] == seq[j - 1] + 1, "position must follow its predecessor in its page"
                else:
                    assert seq[j] % P == 0 and seq[j] >= P, "a page must start at a page boundary"

    def _need(self, prefix: list[int], seq: list[int]) -> int:
        assert self.alloc is not None
        P = self.alloc.page_size
        return sum(-(-s // P) - -(-p // P) for p, s in zip(prefix, seq)) * P

    @precondition(lambda self: self.alloc is not None)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        assert self.alloc is not None
        n_new = data.draw(st.integers(0, 3))
        grow = data.draw(st.lists(st.integers(0, len(self.seqs) - 1), unique=True, max_size=3)) if self.seqs else []
        targets = [self.seqs[i] for i in grow] + [[] for _ in range(n_new)]
        ext = [data.draw(st.integers(0, 20)) for _ in targets]
        prefix = [len(t) for t in targets]
        seq_lens = [p + e for p, e in zip(prefix, ext)]
        last = [t[-1] if t else -1 for t in targets]
        before = self.alloc.available_size()
        need = self._need(prefix, seq_lens)
        out = self.alloc.alloc_extend(prefix, seq_lens, last)
        if out is None:
            assert need > before and self.alloc.available_size() == before
            return
        assert need <= before and self.alloc.available_size() == before - need
        assert out.dtype == torch.int64 and out.numel() == sum(ext)
        grown = [t + [-1] * e for t, e in zip(targets, ext)]
        self._check_new(grown, prefix, out.tolist())
        for i, g in zip(grow, grown):
            self.seqs[i] = g
        self.seqs.extend(grown[len(grow) :])

    @precondition(lambda self: self.alloc is not None and any(self.seqs))
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        assert self.alloc is not None
        live = [i for i, s in enumerate(self.seqs) if s]
        idx = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1))
        seq_lens = [len(self.seqs[i]) + 1 for i in idx]
        before = self.alloc.available_size()
        need = self._need([s - 1 for s in seq_lens], seq_lens)
        out = self.alloc.alloc_decode(seq_lens, [self.seqs[i][-1] for i in idx])
        if out is None:
            assert need > before and self.alloc.available_size() == before
            return
        assert self.alloc.available_size() == before - need
        grown = [self.seqs[i] + [-1] for i in idx]
        self._check_new(grown, [s - 1 for s in seq_lens], out.tolist())
        for i, g in zip(idx, grown):
            self.seqs[i] = g

    @precondition(lambda self: self.alloc is not None and bool(self.seqs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        assert self.alloc is not None
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.alloc.free(torch.tensor(seq, dtype=torch.int64))

    @invariant()
    def pages_accounted(self) -> None:
        if self.alloc is None:
            return
        P = self.alloc.page_size
        free = self.alloc.free_pages.tolist()
        per_seq = [{s // P for s in seq} for seq in self.seqs]
        held = set().union(*per_seq)
        assert sum(map(len, per_seq)) == len(held), "a page is shared by two sequences"
        assert len(set(free)) == len(free)
        assert not held & set(free)
        assert held | set(free) == set(range(1, self.alloc.num_pages + 1))
        assert self.alloc.available_size() == len(free) * P

    def teardown(self) -> None:
        if self.alloc is None:
            return
        for seq in self.seqs:
            self.alloc.free(torch.tensor(seq, dtype=torch.int64))
        assert self.alloc.available_size() == self.alloc.size


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_allocator_machine = AllocatorMachine.TestCase
