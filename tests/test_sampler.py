from dataclasses import dataclass, field

import pytest
import torch

from labkit.sampling import Sampler, SamplingBatchInfo, SamplingParams
from labkit.sampling.sampler import filtered_probs

VOCAB = 64
EOS = {0}


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def make_info(params: list[SamplingParams], reqs: list[FakeReq] | None = None, vocab: int = VOCAB):
    reqs = reqs or [FakeReq(p) for p in params]
    for r in reqs:
        r.sampling_params.normalize().verify(vocab)
    return SamplingBatchInfo.from_requests(reqs, vocab, "cpu", EOS)


def rand_logits(bs: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(bs, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ---- references: one row at a time, written the obvious way ----


def ref_filter(row: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    probs = torch.softmax(row / t, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k != -1:
        keep[:] = False
        keep[torch.topk(probs, min(top_k, len(probs))).indices] = True
    if top_p < 1:
        kept = torch.where(keep, probs, torch.zeros_like(probs))
        kept = kept / kept.sum()
        mass, new_keep = 0.0, torch.zeros_like(keep)
        for i in torch.argsort(kept, descending=True).tolist():
            if mass >= top_p or kept[i] == 0:
                break
            new_keep[i] = True
            mass += kept[i].item()
        keep &= new_keep
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    return torch.where(keep, probs, torch.zeros_like(probs))


FILTER_CASES = [
    dict(top_k=5),
    dict(top_k=1000),  # larger than the vocabulary: clamped, i.e. off
    dict(top_p=0.3),
    dict(top_p=0.9, temperature=0.7),
    dict(min_p=0.2),
    dict(top_k=10, top_p=0.8, min_p=0.05, temperature=1.3),
]


@pytest.mark.parametrize("kw", FILTER_CASES)
def test_filters_match_reference(kw):
    bs = 6
    params = [SamplingParams(**kw) for _ in range(bs)]
    logits = rand_logits(bs, seed=hash(str(kw)) % 1000)
    got = filtered_probs(logits, make_info(params))
    for i, p in enumerate(params):
        want = ref_filter(logits[i], p.temperature, p.top_k, p.top_p, p.min_p)
        assert torch.equal(got[i] > 0, want > 0), kw
        torch.testing.assert_close(got[i], want)


def test_mixed_rows_filter_independently():
    params = [SamplingParams(**kw) for kw in FILTER_CASES] + [SamplingParams()]
    logits = rand_logits(len(params), seed=7)
    got = filtered_probs(logits, make_info(params))
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], ref_filter(logits[i], p.temperature, p.top_k, p.top_p, p.min_p))


def test_greedy_is_argmax_and_input_untouched():
    logits = rand_logits(5)
    before = logits.clone()
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=0)]
    params += [SamplingParams(temperature=0), SamplingParams(temperature=0, top_k=3)]
    out = Sampler()(logits, make_info(params))
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.next_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None
    assert torch.equal(logits, before)


def test_half_precision_logits_sample_as_their_float32_upcast():
    """bf16 logits (the model's dtype on GPU): greedy rows take the argmax without an upcast, ties
    included; penalties, sampling and logprobs see exactly the float32 values."""
    logits = rand_logits(4).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # an exact tie: the first index wins either way
    greedy = make_info([SamplingParams(temperature=0)] * 4)
    out = Sampler()(logits, greedy)
    assert torch.equal(out.next_token_ids, logits.float().argmax(-1)) and out.next_token_ids[0] == 7
    reqs = [
        FakeReq(SamplingParams(temperature=0, return_logprob=True, presence_penalty=1.0), [], [7]),
        FakeReq(SamplingParams(temperature=0.8, top_k=5, return_logprob=True)),
    ] * 2
    half = Sampler(seed=3)(logits, make_info([], reqs))
    full = Sampler(seed=3)(logits.float(), make_info([], reqs))
    assert torch.equal(half.next_token_ids, full.next_token_ids)
    assert half.logprobs.dtype == torch.float32 and torch.equal(half.logprobs, full.logprobs)


def test_greedy_rows_in_mixed_batch():
    logits = rand_logits(4)
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_k=1)]
    params.append(SamplingParams(top_p=0.5))
    out = Sampler(seed=0)(logits, make_info(params))
    assert out.next_token_ids[0] == logits[0].argmax() and out.next_token_ids[2] == logits[2].argmax()


def test_frequency_presence_penalty():
    out_ids = [3, 3, 5]
    req = FakeReq(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), [3, 7], out_ids)
    info = make_info([], [req, FakeReq(SamplingParams())])
    logits = rand_logits(2)
    got = info.penalties.apply(logits)
    want = logits.clone()
    want[0, 3] -= 0.5 * 2 + 1.0
    want[0, 5] -= 0.5 * 1 + 1.0  # prompt token 7 is not penalized (output tokens only)
    torch.testing.assert_close(got, want)


def test_repetition_penalty():
    req = FakeReq(SamplingParams(repetition_penalty=2.0), [1, 2], [3])
    info = make_info([], [req, FakeReq(SamplingParams(), [1, 2], [3])])
    logits = torch.zeros(2, VOCAB)
    logits[:, 1], logits[:, 2], logits[:, 3], logits[:, 4] = 4.0, -4.0, 1.0, 4.0
    got = info.penalties.apply(logits)
    want = logits.clone()
    want[0, 1], want[0, 2], want[0, 3] = 2.0, -8.0, 0.5  # positive divided, negative multiplied
    torch.testing.assert_close(got, want)


def test_plain_batch_skips_penalty_work():
    info = make_info([SamplingParams(), SamplingParams(temperature=0)])
    assert info.penalties is None and info.banned is None


def test_penalty_changes_greedy_choice():
    logits = torch.zeros(1, VOCAB)
    logits[0, 9], logits[0, 8] = 5.0, 4.0
    req = FakeReq(SamplingParams(temperature=0, presence_penalty=2.0), [], [9])
    assert Sampler()(logits, make_info([], [req])).next_token_ids.item() == 8


def test_min_new_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(4, VOCAB)
    logits[:, 0] = 100.0  # EOS
    logits[:, 11] = 90.0  # a stop token id
    logits[:, 12] = 80.0
    mk = lambda **kw: SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[11], **kw)  # noqa: E731 (shorthand)
    reqs = [
        FakeReq(mk(), [1], []),  # too short: EOS and stop id banned
        FakeReq(mk(), [1], [5, 6]),  # long enough: EOS allowed
        FakeReq(mk(ignore_eos=True), [1], [5]),  # EOS does not finish it, so it is not banned
        FakeReq(SamplingParams(min_new_tokens=3, top_k=2, stop_token_ids=[11]), [1], []),  # top-2 banned
    ]
    out = Sampler(seed=0)(logits, make_info([], reqs))
    assert out.next_token_ids.tolist()[:3] == [12, 0, 0]
    assert out.next_token_ids[3].item() not in (0, 11)


def test_top_k_never_leaves_top_k():
    n = 4000
    logits = rand_logits(1).expand(n, VOCAB).contiguous()
    out = Sampler(seed=1)(logits, make_info([SamplingParams(top_k=2) for _ in range(n)]))
    top2 = set(torch.topk(logits[0], 2).indices.tolist())
    seen = set(out.next_token_ids.tolist())
    assert seen == top2


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampling_frequencies_follow_softmax(temperature):
    vocab, n = 5, 40000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    logits = row.expand(n, vocab).contiguous()
    info = make_info([SamplingParams(temperature=temperature) for _ in range(n)], vocab=vocab)
    ids = Sampler(seed=2)(logits, info).next_token_ids
    freq = torch.bincount(ids, minlength=vocab).float() / n
    want = torch.softmax(row / temperature, -1)
    # std of each frequency is <= 0.0025 at n=40000; 0.015 is a six-sigma bound.
    assert (freq - want).abs().max() < 0.015, (freq, want)


def test_seeded_request_independent_of_batch():
    logits_row = rand_logits(1, seed=3)[0]
    target = lambda: FakeReq(SamplingParams(seed=1234, temperature=1.5), [1, 2], [4] * 7)  # noqa: E731 (shorthand)

    alone = Sampler()(logits_row.unsqueeze(0), make_info([], [target()])).next_token_ids[0]

    others = [FakeReq(SamplingParams(seed=99)), FakeReq(SamplingParams()), FakeReq(SamplingParams(top_p=0.5))]
    for pos in range(4):
        reqs = others[:pos] + [target()] + others[pos:]
        logits = rand_logits(len(reqs), seed=10 + pos)
        logits[pos] = logits_row
        got = Sampler()(logits, make_info([], reqs)).next_token_ids[pos]
        assert got == alone, pos


def test_seeded_noise_varies_with_step():
    logits = torch.zeros(1, VOCAB)  # uniform: every token equally likely
    toks = set()
    for step in range(20):
        req = FakeReq(SamplingParams(seed=5), [], [1] * step)
        toks.add(Sampler()(logits, make_info([], [req])).next_token_ids.item())
    assert len(toks) > 5


def test_global_generator_seed_reproducible():
    logits = rand_logits(8)
    params = [SamplingParams() for _ in range(8)]
    a = Sampler(seed=42)(logits, make_info(params)).next_token_ids
    b = Sampler(seed=42)(logits, make_info(params)).next_token_ids
    assert torch.equal(a, b)


def test_logprobs_shapes_and_values():
    logits = rand_logits(3)
    reqs = [
        FakeReq(SamplingParams(temperature=0, return_logprob=True, top_logprobs_num=4)),
        FakeReq(SamplingParams(temperature=0.3, top_k=3)),  # asked for nothing
        FakeReq(SamplingParams(temperature=2.0, return_logprob=True, frequency_penalty=1.0), [], [7, 7]),
    ]
    info = make_info([], reqs)
    out = Sampler(seed=0)(logits, info)
    assert out.logprobs is not None and out.logprobs.shape == (3,)
    # The model's distribution: after penalties, before temperature and filtering.
    model_lp = torch.log_softmax(info.penalties.apply(logits), -1)
    ids = out.next_token_ids
    torch.testing.assert_close(out.logprobs, model_lp[torch.arange(3), ids])
    top_ids, top_lp = out.top_logprobs[0]
    assert top_ids == torch.topk(model_lp[0], 4).indices.tolist()
    assert top_ids[0] == ids[0].item()
    torch.testing.assert_close(torch.tensor(top_lp), torch.topk(model_lp[0], 4).values)
    assert out.top_logprobs[1] == ([], []) and out.top_logprobs[2] == ([], [])


def test_bad_inputs_raise_value_error():
    info = make_info([SamplingParams()])
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, VOCAB), info)
    with pytest.raises(ValueError, match="empty"):
        SamplingBatchInfo.from_requests([], VOCAB, "cpu", EOS)
    with pytest.raises(ValueError, match="top_p"):
        make_info([SamplingParams(top_p=0)])
