"""The n-gram drafter's lookup: latest earlier occurrence (or near the anchor of a copy in
progress), longest n first, never the suffix itself, loops drafted to their full length, and other
requests' outputs when sharing is on; a draft withheld until enough tokens confirm its source."""

from __future__ import annotations

import random
from types import SimpleNamespace

from labkit.config import EngineConfig
from labkit.model_executor.future_map import FutureMap
from labkit.speculative.ngram import NgramDrafter, NgramIndex


def indexed(ids: list[int], min_n: int = 1, max_n: int = 3) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.extend(ids)
    return index


def test_extend_in_pieces_indexes_every_earlier_n_gram_by_its_ends_in_order():
    rng = random.Random(0)
    for _ in range(500):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        pieces = [[rng.randrange(5) for _ in range(rng.choice([0, 1, 2, 5, 17]))] for _ in range(rng.randint(1, 6))]
        index = NgramIndex(min_n, max_n)
        for piece in pieces:
            index.extend(piece)
        ids = [t for piece in pieces for t in piece]
        expected: dict[tuple[int, ...], list[int]] = {}
        for end in range(1, len(ids)):  # every n-gram ending before the newest position
            for n in range(min_n, min(max_n, end) + 1):
                expected.setdefault(tuple(ids[end - n : end]), []).append(end)
        assert index.ids == ids and dict(index.ends) == expected


def test_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert indexed(ids).lookup(ids[-3:], 2)[0] == [7, 8]


def test_lookup_prefers_the_longest_matching_suffix():
    # [2, 3] last occurred before 4, but the 3-gram [1, 2, 3] only before 9.
    ids = [1, 2, 3, 9, 6, 2, 3, 4, 1, 2, 3]
    assert indexed(ids).lookup(ids[-3:], 1)[0] == [9]
    assert indexed(ids, max_n=2).lookup(ids[-2:], 1)[0] == [4]


def test_lookup_finds_nothing_for_an_unseen_suffix_and_never_matches_itself():
    assert indexed([1, 2, 3, 4]).lookup([3, 4], 3)[0] == []
    assert indexed([5]).lookup([5], 2)[0] == []


def test_a_loop_is_drafted_to_the_full_length():
    ids = [4, 1, 2, 1, 2, 1, 2]
    assert indexed(ids, max_n=2).lookup(ids[-2:], 5)[0] == [1, 2, 1, 2, 1]
    assert indexed([7, 7, 7]).lookup([7, 7, 7], 4)[0] == [7, 7, 7, 7]


def test_index_grows_with_the_sequence():
    index = indexed([1, 2, 3])
    index.extend([1, 2, 3, 4, 1, 2])
    assert index.lookup([1, 2], 2)[0] == [3, 4]


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


def test_an_anchor_picks_the_first_occurrence_at_or_after_it():
    index = indexed([1, 5, 6, 1, 8, 9, 1], max_n=1)  # "1" ends at 1 and 4 (the last one is the query)
    assert index.lookup([1], 2) == ([8, 9], 4)  # no anchor: the latest
    assert index.lookup([1], 2, anchor=0) == ([5, 6], 1)
    assert index.lookup([1], 2, anchor=2) == ([8, 9], 4)
    assert index.lookup([1], 2, anchor=5) == ([8, 9], 4)  # none after it: the latest


def unconfirmed_drafter(max_n: int) -> NgramDrafter:
    """A drafter that proposes every draft it finds (speculative_ngram_min_match 0): the lookup alone."""
    config = EngineConfig(speculative_ngram_max_n=max_n, speculative_ngram_min_match=0)
    return NgramDrafter(config, SimpleNamespace(vocab_size=100))


def test_a_draft_waits_until_enough_tokens_before_its_source_confirm_it():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 99, 4, 50, 51, 52]
    drafter = NgramDrafter(EngineConfig(speculative_ngram_max_n=3), SimpleNamespace(vocab_size=100))
    req = fake_req("r", prompt, [1])
    assert drafter.propose([req], [4]) == [[]]  # "1" matches one token: withheld
    req.output_ids += [2]
    assert drafter.propose([req], [4]) == [[3, 4, 5, 6]]  # "1 2": two tokens confirm it
    req.output_ids += [3, 77]  # kept 3, then inserted 77 where 4 was drafted
    assert drafter.propose([req], [4]) == [[]]  # the copy would resume at 4, after nothing that agrees
    req.output_ids += [4]
    assert drafter.propose([req], [4]) == [[]]  # "4" agrees, "77" does not: one token
    req.output_ids += [5]
    # Withheld drafts still moved the copy's anchor on: it goes on from its place in the text.
    assert drafter.propose([req], [4]) == [[6, 7, 8, 99]]
    req.output_ids += [6, FutureMap.future_token(0)]  # the next token still on its way: guessed as 7
    assert drafter.propose([req], [2]) == [[8, 99]]
    for min_match in (0, 1, 2, 3):
        config = EngineConfig(speculative_ngram_max_n=3, speculative_ngram_min_match=min_match)
        fresh = NgramDrafter(config, SimpleNamespace(vocab_size=100))
        assert fresh.propose([fake_req("s", prompt, [2, 3])], [1]) == ([[4]] if min_match <= 2 else [[]])


def test_a_copy_goes_on_from_its_place_after_an_inserted_token():
    # The prompt: a text to copy, then a later "4" followed by something else.
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 99, 4, 50, 51, 52]
    drafter = unconfirmed_drafter(3)
    req = fake_req("r", prompt, [1])
    assert drafter.propose([req], [4]) == [[2, 3, 4, 5]]
    req.output_ids += [2, 3, 77]  # the copy kept 2 and 3, then inserted 77 where 4 was drafted
    assert drafter.propose([req], [4]) == [[4, 5, 6, 7]]  # nothing ever followed 77: 77 was an insertion
    req.output_ids += [4]
    # The copy goes on from its place in the text, not from the latest "4".
    assert drafter.propose([req], [4]) == [[5, 6, 7, 8]]
    fresh = unconfirmed_drafter(3)
    assert fresh.propose([fake_req("s", prompt, [1, 2, 3, 77, 4])], [4]) == [[50, 51, 52, 1]]
    drafter.release(req)
    assert drafter.idle() and not drafter.copying


def test_a_copy_resumes_near_its_anchor_rather_than_at_a_longer_match_far_ahead():
    # The text: 10 11 12 13 14 15 16 ... and further on "9 13 40 41 42": after the copy replaced
    # 12 with 9, the 2-gram "9 13" occurs far ahead, the 1-gram "13" right after the anchor.
    prompt = [10, 11, 12, 13, 14, 15, 16, 60, 61, 62, 63, 64, 65, 9, 13, 40, 41, 42]
    drafter = unconfirmed_drafter(2)
    req = fake_req("r", prompt, [10])
    assert drafter.propose([req], [3]) == [[11, 12, 13]]
    req.output_ids += [11, 9]  # kept 11, then 9 where 12 was drafted
    assert drafter.propose([req], [3]) == [[12, 13, 14]]  # an insertion, as far as it knows
    req.output_ids += [13]  # no: 9 replaced 12
    assert drafter.propose([req], [3]) == [[14, 15, 16]]
    far = unconfirmed_drafter(2)
    assert far.propose([fake_req("s", prompt, [10, 11, 9, 13])], [3]) == [[40, 41, 42]]  # no copy: longest n


def test_a_paused_request_is_seen_copying_again_after_two_tokens_predicted_in_a_row():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    drafter = NgramDrafter(EngineConfig(speculative_ngram_max_n=2), SimpleNamespace(vocab_size=100))
    req = fake_req("r", prompt, [50])
    assert not drafter.copying_again(req)  # nothing ever followed 50: no prediction
    req.output_ids += [3]
    assert not drafter.copying_again(req)  # the miss; 4 predicted next
    req.output_ids += [4]
    assert not drafter.copying_again(req)  # one right
    req.output_ids += [5, FutureMap.future_token(0)]  # a second right one; the next still on its way
    assert drafter.copying_again(req)
    assert drafter.copying_again(req)  # no new token: the same answer
    req.output_ids[-1:] = [9, 6]  # the token in flight was 9, not the predicted 6
    assert not drafter.copying_again(req)
    drafter.release(req)
    assert not drafter.shadow
