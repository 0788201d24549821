"""Speculative decoding changes how many tokens a forward yields, never which: greedy outputs with
every drafter equal the outputs without speculation, on tiny random models (page sizes 1 and 16,
radix cache on and off, with retraction) and on the embedded model."""

from __future__ import annotations

import pytest

from labkit import Engine
from labkit.speculative.base import get_drafter
from tests.speculative.conftest import COPY, FIXED_GAIN, NOISY

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def run(prompts, params, **kw):
    # float32 on every device: in bfloat16 a verify row (a row of a larger batch, a GEMM) and the decode row
    # it stands for (decode attention, the one-row GEMV) round differently and near-ties can flip.
    engine = Engine(dtype="float32", **kw)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return engine, outs


def spec_totals(outs) -> tuple[int, int]:
    metas = [o["meta_info"] for o in outs]
    return sum(m["spec_draft_tokens"] for m in metas), sum(m["spec_accepted_tokens"] for m in metas)


def assert_idle(engine: Engine) -> None:
    usage = engine.pool_usage()
    assert usage.request_owned == 0 and usage.protected == 0
    assert usage.free + usage.evictable == usage.total
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
    assert engine.scheduler.drafter.idle()


@pytest.mark.parametrize(
    "model, page_size, radix, pool, overlap",
    [
        ("tiny-llama", 1, True, 4096, False),
        ("tiny-qwen2", 16, False, 4096, True),
        ("tiny-qwen3", 16, True, 4096, False),
        ("tiny-qwen3", 1, False, 200, True),  # small: requests are retracted
        ("tiny-llama", 16, True, 224, False),
    ],
)
def test_tiny_models_give_the_same_greedy_tokens_with_speculation(model, page_size, radix, pool, overlap):
    """With overlap scheduling the drafter (which drafts ahead) drafts behind the token still on its
    way, and the verify step takes that token after its launch."""
    prompts = [[3 + i, 40 + i, 90, 7 * i % 256] * (4 + i) for i in range(5)]
    kw = dict(model_path=model, load_format="dummy", page_size=page_size, disable_radix_cache=not radix)
    kw |= dict(max_total_tokens=pool, chunked_prefill_size=64, schedule_conservativeness=0.05)
    kw |= dict(overlap_schedule_on_cpu=overlap)
    _, plain = run(prompts, GREEDY, **kw)
    engine, spec = run(prompts, GREEDY, speculative_algorithm=NOISY, speculative_num_draft_tokens=5, **kw, **FIXED_GAIN)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    drafted, accepted = spec_totals(spec)
    assert 0 < accepted < drafted  # runs were accepted and cut
    if pool < 1000:
        assert sum(o["meta_info"]["retractions"] for o in spec) > 0
    assert_idle(engine)


CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def embedded_prompts(embedded_dir):
    engine = Engine(max_total_tokens=4096)
    return [engine.tokenizer(COPY)["input_ids"], engine.tokenizer(engine.apply_chat_template(CHAT))["input_ids"]]


@pytest.mark.slow  # the embedded model
@pytest.mark.parametrize(
    "algorithm, page_size, radix",
    [("ngram", 1, True), ("ngram", 16, False), ("draft", 16, True)],
)
def test_the_embedded_model_gives_the_same_greedy_tokens_with_speculation(
    embedded_prompts, algorithm, page_size, radix
):
    kw = dict(max_total_tokens=4096, page_size=page_size, disable_radix_cache=not radix)
    params = {"temperature": 0, "max_new_tokens": 32}
    _, plain = run(embedded_prompts, params, **kw)
    kw |= FIXED_GAIN
    # The draft model is the embedded model itself: every greedy draft is right.
    engine, spec = run(embedded_prompts, params, speculative_algorithm=algorithm, speculative_num_draft_tokens=3, **kw)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    drafted, accepted = spec_totals(spec)
    assert accepted > 0
    if algorithm == "draft":
        assert accepted == drafted
    assert_idle(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_every_kept_token_is_reported_once_in_the_step_that_kept_it(overlap):
    """The tokens the steps report (what the detokenizer and a stream see) add up to each request's
    output: with overlap, a verify step first takes the token still in flight, then its own."""
    engine = Engine(
        model_path="tiny-qwen3",
        load_format="dummy",
        max_total_tokens=4096,
        overlap_schedule_on_cpu=overlap,
        speculative_algorithm=NOISY,
        speculative_num_draft_tokens=3,
        **FIXED_GAIN,
    )
    prompts = [[3 + i, 40 + i, 90, 7 * i % 256] * (4 + i) for i in range(4)]
    rids = [engine.add_request(input_ids=p, sampling_params=GREEDY) for p in prompts]
    reported: dict[str, list[int]] = {rid: [] for rid in rids}
    while engine.scheduler.has_work():
        for rid, tokens in engine.step().new_tokens.items():
            reported[rid] += tokens
    assert all(reported[rid] == engine.results[rid]["output_ids"] for rid in rids)
    assert sum(engine.results[rid]["meta_info"]["spec_accepted_tokens"] for rid in rids) > 0


@pytest.mark.parametrize("drafts_ahead", [True, False])
def test_with_overlap_a_verify_step_waits_for_the_step_before_only_if_its_drafter_cannot_draft_ahead(
    monkeypatch, drafts_ahead
):
    """A drafter that drafts ahead is launched behind the decode step still on the device (its first
    input is that step's token); one that does not makes the step before give up its overlap. The
    tokens are the same either way."""
    monkeypatch.setattr(get_drafter(NOISY), "drafts_ahead", drafts_ahead)
    kw = dict(model_path="tiny-qwen3", load_format="dummy", max_total_tokens=4096, overlap_schedule_on_cpu=True)
    prompts = [[3 + i, 40 + i, 90, 7 * i % 256] * (4 + i) for i in range(3)]
    _, plain = run(prompts, GREEDY, **kw)
    engine = Engine(dtype="float32", **kw, speculative_algorithm=NOISY, speculative_num_draft_tokens=3, **FIXED_GAIN)
    behind = []
    verify = engine.scheduler.run_verify_batch
    monkeypatch.setattr(
        engine.scheduler,
        "run_verify_batch",
        lambda b, o: (behind.append(engine.scheduler.in_flight is not None), verify(b, o)),
    )
    spec = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    assert behind and any(behind) == drafts_ahead
    assert_idle(engine)


def test_a_request_stopped_by_the_token_in_flight_keeps_none_of_the_verify_step_behind_it():
    """With overlap, a verify step drafted ahead runs behind a token that may end the request (a
    stop id): the request then keeps nothing of the verify step, and its draft slots go back."""
    kw = dict(model_path="tiny-qwen3", load_format="dummy", max_total_tokens=4096, overlap_schedule_on_cpu=True)
    prompts = [[3 + i, 40 + i, 90, 7 * i % 256] * (4 + i) for i in range(4)]
    _, plain = run(prompts, GREEDY, **kw)
    # Each request stops at its own output position; the same greedy tokens lead there.
    params = [{**GREEDY, "stop_token_ids": [o["output_ids"][5 + 3 * i]]} for i, o in enumerate(plain)]
    _, plain_stopped = run(prompts, params, **kw)
    engine = Engine(dtype="float32", **kw, speculative_algorithm=NOISY, speculative_num_draft_tokens=3, **FIXED_GAIN)
    stopped_behind = []
    verify = engine.scheduler.run_verify_batch

    def run_verify(batch, out):
        in_flight = engine.scheduler.in_flight
        verify(batch, out)
        if in_flight is not None:  # a request in both keeps a token of each, unless the first stopped it
            both = [r for r in batch.reqs if r in in_flight[0].reqs]
            stopped_behind.extend(r for r in both if r in out.finished and len(out.new_token_ids[r.rid]) == 1)

    engine.scheduler.run_verify_batch = run_verify
    spec = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain_stopped]
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in spec)
    assert stopped_behind  # some request was stopped by its token in flight
    assert_idle(engine)
