"""The station-8 views (labkit.viz.sampling): the distribution they show is the one labkit's Sampler
draws from, and check_filter (notebook 12's Build-it) fails wrong typical-p filters."""

from __future__ import annotations

import pytest
import torch

from labkit.sampling import SamplingParams
from labkit.sampling.sampler import filtered_probs
from labkit.viz.sampling import (
    check_filter,
    draw_distributions,
    draw_penalties,
    filter_frame,
    next_token_probs,
    penalized_logits,
    sample_many,
    sampling_info,
)

VOCAB = 64


def row(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.5


# ---- typical-p filters: the right one, and wrong ones check_filter must refuse ----


def _typical(logits: torch.Tensor, typical_p: float, *, inclusive: bool = False, by_prob: bool = False) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), -1)
    probs = logp.exp()
    entropy = -(probs * logp).sum(-1, keepdim=True)
    key = -probs if by_prob else (-logp - entropy).abs()
    order = key.argsort(-1)
    sorted_probs = probs.gather(-1, order)
    cum = sorted_probs.cumsum(-1)
    keep_sorted = (cum if inclusive else cum - sorted_probs) < typical_p
    if inclusive:
        keep_sorted[..., 0] = True  # at least one token: the mistake is the boundary, not an empty row
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(-1, keepdim=True)


def typical_filter(logits, typical_p):
    return _typical(logits, typical_p)


def test_check_filter_passes_a_right_typical_filter():
    for p in (0.2, 0.5, 0.9, 0.99):
        assert "all properties hold" in check_filter(typical_filter, p)


def top_p_instead(logits, typical_p):  # the most likely tokens first: not the typical ones
    return _typical(logits, typical_p, by_prob=True)


def one_too_few(logits, typical_p):  # stops once the mass *including* a token reaches typical_p
    return _typical(logits, typical_p, inclusive=True)


def not_renormalized(logits, typical_p):
    return _typical(logits, typical_p) * torch.softmax(logits, -1).max(-1, keepdim=True).values


def keeps_nothing_on_peaked_rows(logits, typical_p):  # one too few, and on a peaked row none: 0 / 0
    logp = torch.log_softmax(logits, -1)
    order = ((-logp) - (-(logp.exp() * logp).sum(-1, keepdim=True))).abs().argsort(-1)
    sorted_probs = logp.exp().gather(-1, order)
    keep = torch.zeros_like(sorted_probs, dtype=torch.bool).scatter(-1, order, sorted_probs.cumsum(-1) < typical_p)
    kept = logp.exp() * keep
    return kept / kept.sum(-1, keepdim=True)


def keeps_everything(logits, typical_p):
    return torch.softmax(logits, -1)


def reweighted(logits, typical_p):  # the right set, but its tokens' ratios changed (a temperature)
    kept = _typical(logits, typical_p) > 0
    p = torch.softmax(logits / 2, -1) * kept
    return p / p.sum(-1, keepdim=True)


def in_place(logits, typical_p):
    out = _typical(logits, typical_p)
    logits.zero_()
    return out


def wrong_shape(logits, typical_p):
    return _typical(logits, typical_p)[0]


@pytest.mark.parametrize(
    "fn, message",
    [
        (top_p_instead, "closer to the entropy"),
        (one_too_few, "< typical_p"),
        (keeps_nothing_on_peaked_rows, "keeps no token"),
        (not_renormalized, "sum to 1"),
        (keeps_everything, "fewer would already reach"),
        (reweighted, "relative weights"),
        (in_place, "changed its input"),
        (wrong_shape, "expected a tensor of shape"),
    ],
)
def test_check_filter_fails_a_wrong_filter(fn, message):
    with pytest.raises(AssertionError, match=message):
        check_filter(fn, 0.9)


# ---- the distribution shown is the sampler's ----


@pytest.mark.parametrize(
    "kw", [{}, {"temperature": 0.6}, {"top_k": 4}, {"top_p": 0.5}, {"min_p": 0.3}, {"top_k": 8, "top_p": 0.6}]
)
def test_next_token_probs_is_filtered_probs_renormalized(kw):
    logits = row(1)
    params = SamplingParams(**kw)
    want = filtered_probs(logits.unsqueeze(0), sampling_info(params, VOCAB))[0]
    got = next_token_probs(logits, params)
    torch.testing.assert_close(got, want / want.sum())
    assert torch.equal(got > 0, want > 0)


def test_a_greedy_request_draws_the_argmax_after_its_penalties():
    logits = row(2)
    best = int(logits.argmax())
    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    probs = next_token_probs(logits, params, output_ids=[best] * 5)
    assert probs.sum() == 1 and probs.max() == 1
    assert int(probs.argmax()) == int(penalized_logits(logits, params, output_ids=[best] * 5).argmax()) != best


def test_penalized_logits_follow_each_penalty():
    logits = row(3)
    logits[5], logits[6] = 3.0, -3.0
    out = [5, 5, 5]
    freq = penalized_logits(logits, SamplingParams(frequency_penalty=0.5), output_ids=out)
    pres = penalized_logits(logits, SamplingParams(presence_penalty=0.5), output_ids=out)
    rep = penalized_logits(logits, SamplingParams(repetition_penalty=2.0), prompt_ids=[6], output_ids=out)
    assert freq[5] == pytest.approx(1.5) and pres[5] == pytest.approx(2.5)
    assert rep[5] == pytest.approx(1.5) and rep[6] == pytest.approx(-6.0)  # CTRL: divide if > 0, else multiply
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[[5, 6]] = False
    for after in (freq, pres, rep):
        assert torch.equal(after[others], logits[others])
    # Frequency and presence count the output only: a prompt full of the token changes nothing.
    assert torch.equal(penalized_logits(logits, SamplingParams(frequency_penalty=2.0), prompt_ids=[5] * 9), logits)


def test_sampling_info_leaves_the_callers_params_as_they_are():
    params = SamplingParams(temperature=1e-9)
    info = sampling_info(params, VOCAB)
    assert info.all_greedy and params.temperature == 1e-9


@pytest.mark.parametrize("kw", [{"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.25, "temperature": 1.5}])
def test_sample_many_draws_only_kept_tokens_in_proportion(kw):
    logits = row(4)
    params = SamplingParams(**kw)
    probs = next_token_probs(logits, params)
    draws = sample_many(logits, params, 4000, chunk=1000)
    assert draws.shape == (4000,)
    assert bool((probs[draws] > 0).all()), "a token outside the kept set was drawn"
    share = torch.bincount(draws, minlength=VOCAB).double() / len(draws)
    assert float((share - probs).abs().max()) < 0.03
    assert torch.equal(draws, sample_many(logits, params, 4000, chunk=1000)), "the sampler's seed fixes the draws"


def test_sample_many_refuses_a_request_seed():
    with pytest.raises(ValueError, match="without a seed"):
        sample_many(row(), SamplingParams(seed=1), 10)


def test_filter_frame_counts_the_kept_tokens_and_their_mass():
    logits = row(5)
    model = torch.softmax(logits, -1)
    frame = filter_frame(logits, {"k": SamplingParams(top_k=7), "given": model})
    assert frame.loc["k", "tokens kept"] == 7
    assert frame.loc["k", "model mass kept"] == pytest.approx(float(model.topk(7).values.sum()), rel=1e-5)
    assert frame.loc["given", "tokens kept"] == VOCAB and frame.loc["given", "model mass kept"] == pytest.approx(1.0)


# ---- the figures ----


def _gids(fig, gid):
    return [p for ax in fig.axes for p in ax.patches + ax.collections if p.get_gid() == gid]


def test_draw_distributions_colours_kept_and_dropped_tokens_and_shows_draws():
    logits = row(6)
    settings = {"top_k=3": SamplingParams(top_k=3), "no filter": SamplingParams()}
    draws = {"top_k=3": sample_many(logits, settings["top_k=3"], 200)}
    fig = draw_distributions(logits, settings, n_tokens=10, draws=draws, title="t")
    assert len(_gids(fig, "kept")) == 3 + 10 and len(_gids(fig, "dropped")) == 7
    assert len(_gids(fig, "rest")) == 2 and len(_gids(fig, "drawn")) == 1
    kept_heights = sorted(p.get_height() for p in _gids(fig, "kept")[:3])
    want = sorted(next_token_probs(logits, settings["top_k=3"]).topk(3).values.tolist())
    assert kept_heights == pytest.approx(want, rel=1e-5)


def test_draw_penalties_draws_the_penalized_logits():
    logits = row(7)
    best = int(logits.argmax())
    params, out = SamplingParams(frequency_penalty=1.0), [best] * 2
    fig = draw_penalties(logits, {"freq": params}, output_ids=out, n_tokens=5)
    bars = _gids(fig, "penalized")
    assert len(bars) == 5
    assert bars[0].get_height() == pytest.approx(float(logits[best]) - 2.0)
    winner = int(penalized_logits(logits, params, output_ids=out).argmax())
    assert fig.axes[0].get_title().endswith(f"most likely now: {winner}")
