"""Tensor parallelism on CPU (gloo): an Engine(tp_size=N) gives the tokens and logprobs of tp_size 1,
with the radix cache, chunked prefill and retraction at work; every rank samples the same tokens;
bad layouts and dead ranks are clear errors, not hangs."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from labkit.engine import Engine

TOP = 5


def _workload(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing prefixes (radix hits), some long enough to be chunked."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    prompts += [[rng.randrange(vocab) for _ in range(rng.randrange(2, 70))] for _ in range(4)]
    return prompts


def _run(engine: Engine, prompts: list[list[int]], params: list[dict]) -> tuple[dict, dict]:
    """Step the engine to the end; (results by rid, what the steps did)."""
    rids = [engine.add_request(input_ids=p, sampling_params=sp) for p, sp in zip(prompts, params)]
    seen = {"retracted": 0, "cache_hit_tokens": 0, "chunked": 0}
    while engine.scheduler.has_work():
        step = engine.step()
        seen["retracted"] += len(step.retracted)
        seen["cache_hit_tokens"] += step.cache_hit_tokens
        seen["chunked"] += engine.scheduler.chunked_req is not None
    return {rid: engine.results.pop(rid) for rid in rids}, seen


def _assert_same(ref: dict, got: dict) -> None:
    for rid, r in ref.items():
        g = got[rid]
        assert g["output_ids"] == r["output_ids"], rid
        assert g["meta_info"]["finish_reason"] == r["meta_info"]["finish_reason"]
        for (lp_r, _), (lp_g, _) in zip(
            r["meta_info"]["output_token_logprobs"], g["meta_info"]["output_token_logprobs"]
        ):
            assert lp_g == pytest.approx(lp_r, abs=1e-4)
        for top_r, top_g in zip(r["meta_info"]["output_top_logprobs"], g["meta_info"]["output_top_logprobs"]):
            _assert_same_top(top_r, top_g)


def _assert_same_top(top_r: list, top_g: list, tol: float = 1e-4) -> None:
    """The same top logprobs (within tol), in the same token order except where two of them tie within
    tol: summing a layer's partial products over ranks rounds differently, so near-ties may swap (at
    the last place, with a token just outside the list)."""
    assert [lp for lp, _ in top_g] == pytest.approx([lp for lp, _ in top_r], abs=tol)
    for i, ((lp, t_r), (_, t_g)) in enumerate(zip(top_r, top_g)):
        if t_g != t_r:
            near = [top_r[j][0] for j in (i - 1, i + 1) if 0 <= j < len(top_r)]
            assert i == len(top_r) - 1 or any(abs(lp - x) <= 2 * tol for x in near), (top_r, top_g)


# On CPU (gloo) even where a GPU is present: more ranks than GPUs would be refused.
CPU = {"device": "cpu"}
TIGHT = {"max_total_tokens": 320, "chunked_prefill_size": 32, "max_running_requests": 8, **CPU}


@pytest.mark.parametrize(
    ("model", "ep_size"),
    [
        ("tiny-llama", 1),
        ("tiny-qwen2", 1),
        ("tiny-qwen3", 1),
        ("tiny-qwen2-moe", 1),
        ("tiny-qwen2-moe", 2),
        ("tiny-qwen3-moe", 2),
    ],
)
def test_tp2_gives_the_tokens_and_logprobs_of_tp1_with_cache_chunks_and_retraction(model, ep_size):
    """ep_size 2: each rank holds half the experts whole (ep_size 1: half of every expert's features)."""
    common = {"model_path": model, "load_format": "dummy", "random_seed": 5, **TIGHT}
    ref_engine = Engine(**common)
    prompts = _workload(ref_engine.model_runner.vocab_size)
    params = [
        {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "return_logprob": True, "top_logprobs_num": TOP}
    ] * len(prompts)
    ref, ref_seen = _run(ref_engine, prompts, params)
    with Engine(**common, tp_size=2, ep_size=ep_size) as engine:
        got, seen = _run(engine, prompts, params)
    assert seen == ref_seen  # the same decisions, step by step
    assert seen["retracted"] > 0 and seen["cache_hit_tokens"] > 0 and seen["chunked"] > 0
    _assert_same(ref, got)


def test_tp2_gives_the_prompt_logprobs_of_tp1_across_chunks_and_cache_hits():
    """Each rank scores the prompt rows over its vocabulary range; the gathered log-softmax is tp 1's."""
    common = {"model_path": "tiny-llama", "load_format": "dummy", "random_seed": 5, **TIGHT}
    prompts = _workload(256, seed=2)
    params = [
        {"max_new_tokens": 3, "temperature": 0, "return_logprob": True, "top_logprobs_num": TOP, "logprob_start_len": s}
        for s in (min(i * 7, len(p) - 1) for i, p in enumerate(prompts))
    ]
    ref, ref_seen = _run(Engine(**common), prompts, params)
    with Engine(**common, tp_size=2) as engine:
        got, seen = _run(engine, prompts, params)
    assert seen == ref_seen and seen["chunked"] > 0 and seen["cache_hit_tokens"] > 0
    _assert_same(ref, got)
    for rid, r in ref.items():
        want, have = r["meta_info"], got[rid]["meta_info"]
        assert [t for _, t in have["input_token_logprobs"]] == [t for _, t in want["input_token_logprobs"]]
        for (lp_w, _), (lp_h, _) in zip(want["input_token_logprobs"], have["input_token_logprobs"]):
            assert lp_h == pytest.approx(lp_w, abs=1e-4) if lp_w is not None else lp_h is None
        for top_w, top_h in zip(want["input_top_logprobs"], have["input_top_logprobs"]):
            assert (top_h is None) == (top_w is None)
            _assert_same_top(top_w or [], top_h or [])


def test_every_rank_samples_the_same_tokens_with_temperature_and_seeds():
    common = {"model_path": "tiny-qwen3", "load_format": "dummy", "enable_trace": True, "max_total_tokens": 2048, **CPU}
    prompts = _workload(256, seed=1)
    params = [
        {"max_new_tokens": 16, "temperature": 1.3, "top_p": 0.9, "ignore_eos": True, **({"seed": i} if i % 2 else {})}
        for i in range(len(prompts))
    ]
    ref, _ = _run(Engine(**common), prompts, params)
    with Engine(**common, tp_size=2) as engine:
        got, _ = _run(engine, prompts, params)
        records = [*engine.tracer.steps, *engine.tracer.rank_steps]
    by_step: dict[int, dict[int, int]] = {}
    for rec in records:
        by_step.setdefault(rec.step, {})[rec.rank] = rec.sampled_digest
    assert len(by_step) > 10 and all(set(ranks) == {0, 1} for ranks in by_step.values())
    assert all(len(set(ranks.values())) == 1 for ranks in by_step.values()), "the ranks sampled different tokens"
    seeded = [rid for i, rid in enumerate(ref) if "seed" in params[i]]
    assert [got[r]["output_ids"] for r in seeded] == [ref[r]["output_ids"] for r in seeded]  # as with tp_size 1


def test_a_rank_layout_the_model_cannot_split_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="tp_size 3 does not fit the model"):
        Engine(model_path="tiny-llama", load_format="dummy", tp_size=3, **CPU)
    with pytest.raises(ValueError, match="does not split evenly over 2 nodes"):
        Engine(model_path="tiny-llama", load_format="dummy", tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:1", **CPU)


def test_a_dead_follower_makes_the_next_step_fail_instead_of_hanging():
    engine = Engine(model_path="tiny-llama", load_format="dummy", tp_size=2, max_total_tokens=1024, **CPU)
    try:
        [follower] = engine._followers.procs
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(timeout=10)
        engine.add_request(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            engine.step()
        assert time.monotonic() - start < 30
    finally:
        engine._followers = None  # nothing left to stop
        from labkit.distributed.parallel_state import destroy_tp_group

        destroy_tp_group(engine.scheduler.tp)


@pytest.mark.slow
def test_tp3_on_the_embedded_model_gives_the_tokens_of_tp1():
    """SmolLM2's 9 query / 3 KV heads split three ways (two ways is refused)."""
    with pytest.raises(ValueError, match="9 query heads"):
        Engine(tp_size=2, **CPU)
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    params = {"max_new_tokens": 12, "temperature": 0, "return_logprob": True, "top_logprobs_num": TOP}
    ref_engine = Engine(max_total_tokens=2048, **CPU)
    ref = dict(enumerate(ref_engine.generate(prompts, params)))
    with Engine(max_total_tokens=2048, tp_size=3, **CPU) as engine:
        got = dict(enumerate(engine.generate(prompts, params)))
    _assert_same(ref, got)
    assert ref[0]["text"] == got[0]["text"]


def test_every_rank_s_steps_are_traced_exported_per_rank_and_drawn(tmp_path):
    from matplotlib.collections import PolyCollection

    from labkit.trace.export import from_perfetto, to_dataframe
    from labkit.viz import draw_rank_timeline

    with Engine(
        model_path="tiny-qwen3", load_format="dummy", tp_size=2, enable_trace=True, max_total_tokens=2048, **CPU
    ) as e:
        e.generate(input_ids=_workload(256)[:4], sampling_params={"max_new_tokens": 6, "ignore_eos": True})
        tracer = e.tracer
    assert [s.step for s in tracer.rank_steps] == [s.step for s in tracer.steps]
    assert {s.rank for s in tracer.rank_steps} == {1} and {s.rank for s in tracer.steps} == {0}
    busy = [s for s in tracer.steps if s.forward_mode != "IDLE"]
    # Per layer one all-reduce after attention and one after the MLP, one for the embedding, one gather.
    layers = e.model_runner.hf_config.num_hidden_layers
    assert all(s.comm_calls == 2 * layers + 2 for s in busy) and all(s.comm_seconds > 0 for s in busy)
    ranks = to_dataframe(tracer, "ranks")
    assert list(ranks["rank"].unique()) == [0, 1] and len(ranks) == 2 * len(tracer.steps)
    trace = tracer.save_perfetto(tmp_path / "tp.json")
    again = from_perfetto(trace)
    assert [(s.step, s.rank, s.comm_calls) for s in again.rank_steps] == [
        (s.step, s.rank, s.comm_calls) for s in tracer.rank_steps
    ]
    assert "steps, rank 1" in trace.read_text()
    fig = draw_rank_timeline(again)
    gids = {c.get_gid() for c in fig.axes[0].collections if isinstance(c, PolyCollection)}
    assert {f"rank{r}|{s.step}" for r in (0, 1) for s in busy} <= gids
    assert f"rank1|{busy[0].step}|comm" in gids


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_tp2_loads_sliced_hf_checkpoints_with_biases_and_an_untied_head(name, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from labkit.model_loader.loader import load_config

    config = load_config(name)
    config.tie_word_embeddings = False
    hf = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # HF zero-inits biases: randomize everything so every slice matters
        for pname, p in hf.named_parameters():
            p.copy_(
                1.0 + 0.1 * torch.randn(p.shape, generator=gen)
                if "norm" in pname
                else 0.2 * torch.randn(p.shape, generator=gen)
            )
    hf.save_pretrained(tmp_path)
    prompts = _workload(config.vocab_size, seed=3)[:5]
    params = [{"max_new_tokens": 10, "temperature": 0, "return_logprob": True, "top_logprobs_num": TOP}] * len(prompts)
    ref, _ = _run(Engine(model_path=str(tmp_path), max_total_tokens=2048, **CPU), prompts, params)
    with Engine(model_path=str(tmp_path), max_total_tokens=2048, tp_size=2, **CPU) as engine:
        got, _ = _run(engine, prompts, params)
    _assert_same(ref, got)


def test_more_ranks_on_a_node_than_gpus_is_a_clear_error(monkeypatch):
    import torch

    from labkit.model_executor.model_runner import resolve_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda", 1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="needs GPU 2, but 2 are visible"):
        resolve_device("cuda", 2)
    assert resolve_device("cpu", 5) == torch.device("cpu")  # CPU ranks share the one device
