"""Sampling parameters keep their meaning under speculation: stops inside an accepted run end the
request there, logprobs are those of the tokens kept, penalties and seeds act per position, and
sampled tokens follow the target model's distribution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from labkit import Engine
from labkit.sampling.sampler import Sampler
from tests.speculative.conftest import COPY, FIXED_GAIN


@pytest.fixture(scope="module")
def engines(embedded_dir):
    # float32 on every device: in bfloat16 a verify row (a row of a larger batch, a GEMM) and the
    # decode row it replaces round differently, which flips near-ties and moves logprobs by ~1e-2.
    kw = {"max_total_tokens": 4096, "dtype": "float32"}
    plain = Engine(**kw)
    spec = Engine(**kw, **FIXED_GAIN, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
    return plain, spec


def both(engines, params):
    plain, spec = engines
    a, b = plain.generate(COPY, params), spec.generate(COPY, params)
    assert b["meta_info"]["spec_verify_ct"] > 0  # the run did speculate
    return a, b


@pytest.mark.slow  # the embedded model
def test_the_copy_workload_is_accepted_in_runs(engines):
    _, out = both(engines, {"temperature": 0, "max_new_tokens": 24})
    meta = out["meta_info"]
    assert meta["spec_accepted_tokens"] >= 12
    assert meta["spec_verify_ct"] < 24 - meta["spec_accepted_tokens"] + 2  # fewer steps than tokens


@pytest.mark.slow  # the embedded model
@pytest.mark.parametrize(
    "params",
    [
        {"max_new_tokens": 7},  # the limit falls inside an accepted run
        {"max_new_tokens": 40, "stop": ["lazy"]},
        {"max_new_tokens": 40, "stop": [" dog.", "wizards"]},
        {"max_new_tokens": 40, "min_new_tokens": 20, "stop": ["lazy"]},
    ],
)
def test_stop_conditions_inside_an_accepted_run_end_the_request_there(engines, params):
    a, b = both(engines, {"temperature": 0, **params})
    assert b["output_ids"] == a["output_ids"] and b["text"] == a["text"]
    assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]


@pytest.mark.slow  # the embedded model
def test_a_stop_token_id_inside_an_accepted_run_ends_the_request_there(engines):
    a, _ = both(engines, {"temperature": 0, "max_new_tokens": 20})
    stop_id = a["output_ids"][9]
    a, b = both(engines, {"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [stop_id]})
    assert b["output_ids"] == a["output_ids"] and b["output_ids"][-1] == stop_id
    assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"]


@pytest.mark.slow  # the embedded model
def test_logprobs_are_those_of_the_tokens_kept(engines):
    params = {"temperature": 0, "max_new_tokens": 20, "return_logprob": True, "top_logprobs_num": 3}
    a, b = both(engines, params)
    ma, mb = a["meta_info"], b["meta_info"]
    assert [t for _, t in mb["output_token_logprobs"]] == b["output_ids"] == a["output_ids"]
    for (la, _), (lb, _) in zip(ma["output_token_logprobs"], mb["output_token_logprobs"]):
        assert lb == pytest.approx(la, abs=1e-4)
    assert [[i for _, i in top] for top in mb["output_top_logprobs"]] == [
        [i for _, i in top] for top in ma["output_top_logprobs"]
    ]


@pytest.mark.slow  # the embedded model
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0, "frequency_penalty": 0.6, "presence_penalty": 0.3},
        {"temperature": 0, "repetition_penalty": 1.1},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7},
        {"temperature": 1.0, "min_p": 0.05, "seed": 11, "frequency_penalty": 0.2},
    ],
)
def test_penalties_and_seeds_act_per_position(engines, params):
    """A verify row samples as the decode step at its position would: with the drafts before it in
    the output (penalties) and that step's noise (seeds), so the output is the same as without."""
    a, b = both(engines, {"max_new_tokens": 24, **params})
    assert b["output_ids"] == a["output_ids"]


def token_pairs(engine: Engine, n: int, params: dict) -> tuple[Counter, int, int]:
    engine.scheduler.model_runner.sampler = Sampler(seed=1234)  # unseeded rows: the sampler's noise
    outs = engine.generate(input_ids=[[5, 17, 42, 99, 42]] * n, sampling_params=params)
    drafted = sum(o["meta_info"]["spec_draft_tokens"] for o in outs)
    accepted = sum(o["meta_info"]["spec_accepted_tokens"] for o in outs)
    return Counter(tuple(o["output_ids"][:2]) for o in outs), drafted, accepted


def chi2_homogeneity_pvalue(a: Counter, b: Counter, min_count: int = 10) -> float:
    """Two-sample chi-square test of equal distributions (cells rarer than min_count pooled)."""
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= min_count]
    table = [[a[k], b[k]] for k in keys]
    table.append([sum(a.values()) - sum(r[0] for r in table), sum(b.values()) - sum(r[1] for r in table)])
    t = torch.tensor(table, dtype=torch.float64)
    t = t[t.sum(1) > 0]
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = ((t - expected) ** 2 / expected).sum()
    df = t.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_sampled_tokens_follow_the_target_distribution():
    """The first two sampled tokens of 1,500 unseeded requests, with and without speculation (the
    draft model is the target itself, drafting greedily: accepted with probability p(draft)). The
    two-sample chi-square test rejects equal distributions at p < 0.001: a correct sampler fails
    this test with probability 0.001 for a random choice of seeds; with the fixed seeds here it
    passes or fails the same way every run."""
    kw = dict(model_path="tiny-qwen3", load_format="dummy", max_total_tokens=16384, max_running_requests=512)
    params = {"temperature": 0.5, "top_k": 6, "max_new_tokens": 3, "ignore_eos": True}
    plain, _, _ = token_pairs(Engine(**kw), 1500, params)
    spec_kw = dict(FIXED_GAIN, speculative_algorithm="draft", speculative_draft_model_path="tiny-qwen3")
    spec, drafted, accepted = token_pairs(
        Engine(**kw, **spec_kw, speculative_draft_load_format="dummy", speculative_num_draft_tokens=2), 1500, params
    )
    assert 0.1 * drafted < accepted < 0.9 * drafted  # both acceptance and rejection happen often
    assert len(plain) > 4  # the pairs are spread, not one answer
    assert chi2_homogeneity_pvalue(plain, spec) > 1e-3
