"""labkit.bench.speculative on a tiny random model: the rows' fields are consistent, greedy outputs with
speculation equal the plain ones, and a drafter that cannot be built is skipped."""

from __future__ import annotations

import json

from labkit.bench.speculative import (
    PLAIN,
    TEXTS_PER_COPY,
    WORKLOAD_FILE,
    _requests,
    bench,
    chat_workloads,
    make_engines,
    markdown_table,
)

TINY = {"model_path": "tiny-llama", "load_format": "dummy", "device": "cpu", "max_total_tokens": 2048}


def test_bench_rows_on_a_tiny_model(capsys):
    # Every n-gram draft proposed (min_match 0): a random model's outputs seldom confirm one, and this
    # test pins the bench's bookkeeping of verify steps, not the drafter's rule.
    engines = make_engines(
        ["ngram", "draft", "no-such-drafter"], 3, draft_model_path="tiny-llama", speculative_ngram_min_match=0, **TINY
    )
    assert list(engines) == [PLAIN, "ngram", "draft"]
    assert "skipping no-such-drafter" in capsys.readouterr().out
    workloads = {"loop": [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [20 + i for i in range(12)]]}
    rows = bench(engines, workloads, batch_sizes=[1, 3], output_len=12, repeats=2, min_requests=2, ignore_eos=True)
    assert [(r.batch_size, r.algorithm) for r in rows] == [(b, a) for b in (1, 3) for a in (PLAIN, "ngram", "draft")]
    for r in rows:
        assert r.requests == (2 if r.batch_size == 1 else 3)
        assert r.output_tokens == 12 * r.requests  # EOS ignored
        assert 0 < r.tok_s_min <= r.tok_s <= r.tok_s_max
        assert r.mismatches == 0  # greedy: speculation changes no token
        assert 0 < r.speedup_lo <= r.speedup <= r.speedup_hi
        assert 0.0 <= r.accept_rate <= 1.0 and r.verify_steps >= 0
        if r.algorithm == PLAIN:
            assert (r.speedup, r.speedup_lo, r.speedup_hi, r.accept_len) == (1.0, 1.0, 1.0, 1.0)
            assert (r.accept_rate, r.verify_steps, r.from_drafts) == (0.0, 0.0, 0.0)
        else:
            assert 1.0 <= r.accept_len <= 1 + 3 and r.verify_steps > 0
    draft = [r for r in rows if r.algorithm == "draft"]
    assert all(r.accept_rate == 1.0 for r in draft)  # the target drafts for itself
    for r in draft:  # every verify step yields its drafts and one token of the target's own
        assert abs(r.from_drafts - (1 - r.verify_steps / (r.output_tokens / r.requests))) < 0.1
    table = markdown_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| loop | 3 | ngram |" in table


def test_workloads_and_groups():
    workloads = chat_workloads()
    assert set(workloads) == {"copy", "chat"} and all(len(p) >= 16 for p in workloads.values())
    first = workloads["copy"][0][0]["content"]
    assert first.startswith("Repeat the following text exactly")
    texts = json.loads(WORKLOAD_FILE.read_text())["copy_texts"]
    assert all(t in first for t in texts[:TEXTS_PER_COPY]) and texts[TEXTS_PER_COPY] not in first
    prompts = [[i] for i in range(5)]
    assert _requests(prompts, 1, 3) == [[[0]], [[1]], [[2]]]
    assert _requests(prompts, 4, 1) == [[[0], [1], [2], [3]]]
    assert _requests(prompts, 2, 3) == [[[0], [1]], [[2], [3]]]
    assert _requests(prompts, 2, 1, min_groups=3) == [[[0], [1]], [[2], [3]], [[4], [0]]]
