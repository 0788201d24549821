"""The n-gram drafter's lookup: latest earlier occurrence, longest n first, never the suffix itself,
loops drafted to their full length, and other requests' outputs when sharing is on."""

from __future__ import annotations

from types import SimpleNamespace

from labkit.config import EngineConfig
from labkit.speculative.ngram import NgramDrafter, NgramIndex


def indexed(ids: list[int], min_n: int = 1, max_n: int = 3) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.extend(ids)
    return index


def test_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert indexed(ids).lookup(ids[-3:], 2) == [7, 8]


def test_lookup_prefers_the_longest_matching_suffix():
    # [2, 3] last occurred before 4, but the 3-gram [1, 2, 3] only before 9.
    ids = [1, 2, 3, 9, 6, 2, 3, 4, 1, 2, 3]
    assert indexed(ids).lookup(ids[-3:], 1) == [9]
    assert indexed(ids, max_n=2).lookup(ids[-2:], 1) == [4]


def test_lookup_finds_nothing_for_an_unseen_suffix_and_never_matches_itself():
    assert indexed([1, 2, 3, 4]).lookup([3, 4], 3) == []
    assert indexed([5]).lookup([5], 2) == []


def test_a_loop_is_drafted_to_the_full_length():
    ids = [4, 1, 2, 1, 2, 1, 2]
    assert indexed(ids, max_n=2).lookup(ids[-2:], 5) == [1, 2, 1, 2, 1]
    assert indexed([7, 7, 7]).lookup([7, 7, 7], 4) == [7, 7, 7, 7]


def test_index_grows_with_the_sequence():
    index = indexed([1, 2, 3])
    index.extend([1, 2, 3, 4, 1, 2])
    assert index.lookup([1, 2], 2) == [3, 4]


def fake_req(rid: str, prompt: list[int], output: list[int]) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_ids=prompt, output_ids=output)


def test_shared_contexts_draft_from_finished_requests_only_when_asked():
    target = SimpleNamespace(vocab_size=100)
    done = fake_req("a", [10, 11], [12, 13, 14, 15])
    asking = fake_req("b", [50, 12, 13], [])
    for share, expected in ((True, [[14, 15]]), (False, [[]])):
        drafter = NgramDrafter(EngineConfig(speculative_ngram_share=share), target)
        drafter.propose([done], [2])
        drafter.release(done)
        assert drafter.propose([asking], [2]) == expected
        assert drafter.idle() is False  # "b" is live
        drafter.release(asking)
        assert drafter.idle()
