import dataclasses

import pytest
import torch

from labkit.sampling import SamplingParams

VOCAB = 100


def test_defaults_verify():
    p = SamplingParams()
    p.verify(VOCAB)
    assert not p.is_greedy
    assert p.top_k == -1 and p.max_new_tokens == 128


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_k": 1},
        {"temperature": 0, "top_k": 5},
    ],
)
def test_is_greedy(kwargs):
    assert SamplingParams(**kwargs).is_greedy


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"top_logprobs_num": -1}, "top_logprobs_num"),
        ({"top_logprobs_num": 21}, "top_logprobs_num"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_verify_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).verify(VOCAB)


def test_verify_accepts_edges():
    SamplingParams(
        max_new_tokens=1,
        min_new_tokens=1,
        temperature=0,
        top_p=1.0,
        top_k=10 * VOCAB,
        min_p=1.0,
        frequency_penalty=-2,
        presence_penalty=2,
        repetition_penalty=0.5,
        stop=["a", "bc"],
        stop_token_ids=[0, VOCAB - 1],
        top_logprobs_num=20,
        seed=-3,
    ).verify(VOCAB)


def test_normalize():
    p = SamplingParams(stop="END").normalize()
    assert p.stop == ["END"] and p.stop_token_ids == []
    assert SamplingParams().normalize().stop == []
    assert SamplingParams(stop=("a", "b")).normalize().stop == ["a", "b"]


def test_from_dict():
    p = SamplingParams.from_dict({"temperature": 0.5, "max_new_tokens": 8, "stop": "x"})
    assert p.temperature == 0.5 and p.max_new_tokens == 8 and p.stop == "x"
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_from_dict_rejects_unknown_and_non_dict():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams.from_dict({"max_tokens": 3})
    with pytest.raises(ValueError, match="dict"):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"repetition_penalty": 1e308}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"max_new_tokens": 2**64}, "max_new_tokens"),
        ({"top_k": 10**30}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"temperature": 10**400}, "temperature"),
    ],
)
def test_verify_rejects_extremes(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).verify(VOCAB)


def test_verify_accepts_64_bit_edges():
    SamplingParams(seed=2**64 - 1, top_k=2**63 - 1, max_new_tokens=2**63 - 1, repetition_penalty=2.0).verify(VOCAB)
    SamplingParams(seed=-(2**63), repetition_penalty=1e-6).verify(VOCAB)


@pytest.mark.parametrize("kwargs", [{"temperature": 1e-300}, {"temperature": 1e-7}, {"top_p": 1e-300}])
def test_temperature_or_top_p_below_eps_normalizes_to_greedy(kwargs):
    p = SamplingParams(**kwargs)
    p.verify(VOCAB)
    assert p.normalize().is_greedy


def test_small_but_usable_temperature_stays_sampled():
    assert not SamplingParams(temperature=1e-3, top_p=1e-3).normalize().is_greedy


@pytest.mark.parametrize("kwargs", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"top_p": 1e-300, "seed": 7}])
def test_underflowing_temperature_or_top_p_samples_the_argmax(kwargs):
    from labkit.sampling import Sampler, SamplingBatchInfo

    @dataclasses.dataclass
    class Req:
        sampling_params: SamplingParams
        origin_input_ids: list = dataclasses.field(default_factory=lambda: [1])
        output_ids: list = dataclasses.field(default_factory=list)

    reqs = [Req(SamplingParams(**kwargs)) for _ in range(8)]
    for r in reqs:
        r.sampling_params.verify(VOCAB)
        r.sampling_params.normalize()
    # One ordinary sampled row in the batch, so the batch is not all greedy.
    reqs.append(Req(SamplingParams(temperature=0.7).normalize()))
    info = SamplingBatchInfo.from_requests(reqs, VOCAB, "cpu", eos_token_ids=set())
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    out = Sampler(seed=0)(logits, info).next_token_ids
    assert out[:-1].tolist() == logits[:-1].argmax(dim=-1).tolist()
