"""The Engine's user-facing API on the embedded model: input forms, step-wise control, bad input,
abort, stop strings, seeds, logprobs, and that memory is back at idle after every request."""

from __future__ import annotations

import pytest

from labkit import Engine, SamplingParams

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_new_tokens": 16}
pytestmark = pytest.mark.slow  # every test runs the embedded model


@pytest.fixture(scope="module")
def engine():
    # The CPU in float32 on every machine: these tests pin exact greedy choices, which bfloat16 on a
    # GPU can flip at near-ties (on an H200 this chat prompt answered "L'Étoile, ..." instead of
    # "The capital of France is Paris." in some of these tests, and two top tokens had equal
    # logprobs), and step-by-step reporting, which overlap scheduling (the CUDA default) shifts by
    # a step. tests/test_engine_devices.py runs the embedded model on CUDA.
    return Engine(max_total_tokens=4096, chunked_prefill_size=64, device="cpu")


def assert_idle(engine: Engine) -> None:
    """No request holds anything: every KV slot is free or evictable cache, every request slot free."""
    usage = engine.pool_usage()
    assert usage.request_owned == 0 and usage.protected == 0
    assert usage.free + usage.evictable == usage.total
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
    assert not engine.scheduler.has_work()


def test_text_ids_and_messages_give_the_same_answer(engine):
    text = engine.apply_chat_template(CHAT)
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    by_messages = engine.generate(messages=CHAT, sampling_params=GREEDY)
    by_ids = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert by_messages["output_ids"] == by_ids["output_ids"]
    assert "Paris" in by_messages["text"]
    meta = by_messages["meta_info"]
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == len(by_messages["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["timestamps"]["arrival"] <= meta["timestamps"]["first_token"] <= meta["timestamps"]["finished"]
    assert by_ids["meta_info"]["cached_tokens"] > 0  # the same prompt ran just before
    batch = engine.generate(["Hello", "The sky is"], {"temperature": 0, "max_new_tokens": 4})
    assert isinstance(batch, list) and len(batch) == 2
    assert_idle(engine)


@pytest.mark.parametrize(
    "params, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": "hot"}, "temperature"),
        ({"no_such_param": 1}, "no_such_param"),
    ],
)
def test_bad_sampling_params_raise_value_error_and_engine_stays_usable(engine, params, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(messages=CHAT, sampling_params=params)
    assert_idle(engine)
    assert engine.generate("Hi", {"temperature": 0, "max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_bad_prompts_raise_value_error(engine):
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate("hi", input_ids=[1, 2])
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(input_ids=[1, 10**9])
    with pytest.raises(ValueError, match="messages"):
        engine.generate(messages=[{"content": "no role"}])
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[])
    # A batch with one bad request queues nothing.
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(["fine", "also fine"], [GREEDY, {"top_p": 2}])
    assert_idle(engine)


def test_prompt_longer_than_context_is_rejected():
    small = Engine(max_total_tokens=1024, context_length=64)
    with pytest.raises(ValueError, match="context length"):
        small.generate(input_ids=list(range(100)))
    out = small.generate(
        input_ids=list(range(10, 60)), sampling_params={"temperature": 0, "max_new_tokens": 100, "ignore_eos": True}
    )
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["prompt_tokens"] + out["meta_info"]["completion_tokens"] == 64


def test_unknown_policy_and_option_raise_value_error():
    with pytest.raises(ValueError, match="schedule policy"):
        Engine(schedule_policy="shortest-dream-first", max_total_tokens=256)
    with pytest.raises(ValueError, match="unknown engine option"):
        Engine(max_total_tokns=256)


def test_step_reports_prefill_then_decode_and_pieces_make_the_text(engine):
    a = engine.add_request(messages=CHAT, sampling_params=GREEDY)
    b = engine.add_request(
        "Once upon a time", sampling_params={"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    )
    first = engine.step()
    assert first.forward_mode == "EXTEND" and first.rids == [a, b]
    assert set(first.new_tokens) == {a, b}
    assert first.pool.free + first.pool.evictable + first.pool.protected + first.pool.request_owned == first.pool.total
    assert first.pool.request_owned + first.pool.protected > 0
    pieces = {a: first.new_text.get(a, ""), b: first.new_text.get(b, "")}
    modes = []
    while engine.scheduler.has_work():
        s = engine.step()
        modes.append(s.forward_mode)
        for rid, piece in s.new_text.items():
            pieces[rid] += piece
    assert modes[0] == "DECODE"
    assert engine.results[b]["meta_info"]["completion_tokens"] == 5
    for rid in (a, b):
        assert pieces[rid] == engine.results.pop(rid)["text"]
    assert_idle(engine)


def test_abort_returns_memory(engine):
    rid = engine.add_request(
        "Tell me a long story about dragons.", sampling_params={"max_new_tokens": 200, "ignore_eos": True}
    )
    engine.step()
    engine.step()
    assert engine.abort(rid)
    engine.run_until_done()
    result = engine.results.pop(rid)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert_idle(engine)
    waiting = engine.add_request("never runs")
    assert engine.abort(waiting)
    engine.run_until_done()
    assert engine.results.pop(waiting)["meta_info"]["finish_reason"]["type"] == "abort"
    assert not engine.abort("no-such-rid")
    assert_idle(engine)


def test_stop_string_truncates_text_and_is_reported(engine):
    full = engine.generate(messages=CHAT, sampling_params=GREEDY)["text"]
    assert "Paris" in full
    out = engine.generate(messages=CHAT, sampling_params={**GREEDY, "stop": ["Paris", "never-there"]})
    assert out["text"] == full[: full.index("Paris")]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Paris", "message": None}
    assert out["meta_info"]["matched_stop"] == "Paris"


def test_stop_token_ids_and_min_new_tokens(engine):
    greedy = engine.generate(messages=CHAT, sampling_params=GREEDY)["output_ids"]
    out = engine.generate(messages=CHAT, sampling_params={**GREEDY, "stop_token_ids": [greedy[2]]})
    assert out["output_ids"] == greedy[:3]
    assert out["meta_info"]["matched_stop"] == greedy[2]
    eos = next(iter(engine.model_runner.eos_token_ids))
    long = engine.generate(messages=CHAT, sampling_params={**GREEDY, "min_new_tokens": 12, "max_new_tokens": 12})
    assert eos not in long["output_ids"] and len(long["output_ids"]) == 12


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 12, "seed": 1234, "ignore_eos": True}
    alone = engine.generate("The weather today is", params)["output_ids"]
    crowd = engine.generate(
        ["Something else entirely", "The weather today is", "A third prompt"],
        [{"max_new_tokens": 7}, params, {"temperature": 0.7, "max_new_tokens": 12}],
    )
    assert crowd[1]["output_ids"] == alone
    other_seed = engine.generate("The weather today is", {**params, "seed": 99})["output_ids"]
    assert other_seed != alone


def test_logprobs(engine):
    out = engine.generate(messages=CHAT, sampling_params={**GREEDY, "return_logprob": True, "top_logprobs_num": 3})
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == len(out["output_ids"])
    for (lp, tok), top, chosen in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], out["output_ids"]):
        assert tok == chosen and lp <= 0
        assert len(top) == 3 and top[0][1] == chosen  # greedy picks the most likely token
        assert top[0][0] == pytest.approx(lp, abs=1e-5)


def test_sampling_params_object_is_accepted(engine):
    out = engine.generate("Hi", SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    assert len(out["output_ids"]) == 3
