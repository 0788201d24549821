"""Notebook 04's Build-it: check_allocator passes the given answer and rejects page allocators that
disagree with TokenToKVPoolAllocator or break the slot layout (random request sequences)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from labkit.mem_cache import TokenToKVPoolAllocator
from tests.notebook_cells import run_cells


@pytest.fixture(scope="module")
def notebook():
    names = {"random": random, "torch": torch, "TokenToKVPoolAllocator": TokenToKVPoolAllocator}
    return run_cells("04_paged_memory", "build-alloc-answer", "build-alloc-check", **names)


def test_the_notebooks_answer_passes(notebook):
    notebook["check_allocator"](notebook["PageAllocator"])


# Each wrong allocator is the notebook's answer (`base`) with one mistake.


def always_a_new_page(base):
    class AlwaysANewPage(base):
        """Ignores the room left in a request's partly filled last page."""

        def alloc(self, prefix_len, seq_len, last_loc):
            P = self.page_size
            need = -(-(seq_len - prefix_len) // P)
            if need > len(self.free_pages):
                return None
            pages, self.free_pages = self.free_pages[:need], self.free_pages[need:]
            return [pages[k // P] * P + k % P for k in range(seq_len - prefix_len)]

    return AlwaysANewPage


def never_gives_back(base):
    class NeverGivesBack(base):
        def free(self, slots):
            pass

    return NeverGivesBack


def hands_out_page_zero(base):
    class HandsOutPageZero(base):
        def __init__(self, size, page_size):
            super().__init__(size, page_size)
            self.free_pages = list(range(size // page_size))

    return HandsOutPageZero


def takes_pages_when_short(base):
    class TakesPagesWhenShort(base):
        def alloc(self, prefix_len, seq_len, last_loc):
            out = super().alloc(prefix_len, seq_len, last_loc)
            if out is None:
                self.free_pages = self.free_pages[1:]
            return out

    return TakesPagesWhenShort


def no_double_free_check(base):
    class NoDoubleFreeCheck(base):
        def free(self, slots):
            self.free_pages += sorted({s // self.page_size for s in slots} - set(self.free_pages))

    return NoDoubleFreeCheck


def fills_pages_backwards(base):
    class FillsPagesBackwards(base):
        def alloc(self, prefix_len, seq_len, last_loc):
            out = super().alloc(prefix_len, seq_len, last_loc)
            P = self.page_size
            return None if out is None else [s // P * P + (P - 1 - s % P) for s in out]

    return FillsPagesBackwards


def frees_slots_not_pages(base):
    class FreesSlotsNotPages(base):
        def free(self, slots):
            pages = [s // self.page_size for s in slots]  # a page once per slot it holds
            if set(pages) & set(self.free_pages):
                raise RuntimeError("double free")
            self.free_pages += pages

    return FreesSlotsNotPages


@pytest.mark.parametrize(
    ("mistake", "complaint"),
    [
        (always_a_new_page, "must follow position"),
        (never_gives_back, "available_size()"),
        (hands_out_page_zero, "outside the usable pages"),
        (takes_pages_when_short, "refused, but took pages"),
        (no_double_free_check, "did not raise RuntimeError"),
        (fills_pages_backwards, "must be a page's first"),
        (frees_slots_not_pages, "available_size()"),
    ],
)
def test_check_allocator_rejects_a_wrong_allocator(notebook, mistake, complaint):
    with pytest.raises(AssertionError, match=re.escape(complaint)):
        notebook["check_allocator"](mistake(notebook["PageAllocator"]))
