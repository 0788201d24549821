"""Packed batches (labkit.viz.packed), checked against real forwards of the tiny random-weight model:
a MIXED step (a prompt with a cached prefix, a prompt without one, a decode) and the DECODE step
after it, recorded with `record_forwards`."""

from __future__ import annotations

import pytest
import torch

from labkit import Engine
from labkit.viz.packed import (
    attention_errors,
    attention_mask,
    check_attention_mask,
    check_positions,
    mask_error,
    padding_cost,
    record_forwards,
)
from labkit.viz.packed_figures import draw_attention_mask, draw_packed_batch, draw_req_to_token

SHARED = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # a "system prompt" the requests begin with
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    return Engine(model_path="tiny-llama", load_format="dummy", enable_mixed_chunk=True, max_total_tokens=1024)


@pytest.fixture(scope="module")
def steps(engine):
    """(MIXED step, DECODE step): `cached` finds 13 tokens of `first` in the radix cache, `fresh`
    nothing, and `running` decodes in both."""
    engine.generate(input_ids=SHARED + [20, 21, 22, 23], sampling_params=GREEDY)  # leaves its KV in the tree
    engine.add_request(input_ids=SHARED + [30, 31, 32, 33, 34, 35], sampling_params=GREEDY, rid="running")
    engine.step()
    engine.add_request(input_ids=SHARED + [20, 21, 22, 40, 41, 42, 43], sampling_params=GREEDY, rid="cached")
    engine.add_request(input_ids=[50, 51, 52], sampling_params=GREEDY, rid="fresh")
    with record_forwards(engine) as forwards:
        engine.step()
        engine.step()
    mixed, decode = forwards
    assert (mixed.forward_mode, decode.forward_mode) == ("MIXED", "DECODE")
    return mixed, decode


def true_positions(prefix_lens, extend_lens):
    return [p + k for p, n in zip(prefix_lens, extend_lens) for k in range(n)]


def test_a_recorded_step_is_the_forward_batch_of_the_step(steps):
    mixed, decode = steps
    assert mixed.rids == ["cached", "fresh", "running"]  # prefills first, then the decodes folded in
    assert mixed.prefix_lens[:2] == [13, 0] and mixed.extend_lens == [4, 3, 1]
    assert mixed.input_ids[:7] == [40, 41, 42, 43, 50, 51, 52]
    assert mixed.positions == true_positions(mixed.prefix_lens, mixed.extend_lens)
    for step in steps:
        assert step.seq_lens == [p + n for p, n in zip(step.prefix_lens, step.extend_lens)]
        assert [len(r) for r in step.req_to_token] == [len(t) for t in step.tokens] == step.seq_lens
        # out_cache_loc is the end of each request's row; input_ids are the end of its tokens.
        assert step.out_cache_loc == [s for row, p in zip(step.req_to_token, step.prefix_lens) for s in row[p:]]
        assert step.input_ids == [t for toks, p in zip(step.tokens, step.prefix_lens) for t in toks[p:]]
        assert tuple(step.logits.shape) == (step.batch_size, 256)
    assert decode.rids == ["running", "cached", "fresh"] and decode.extend_lens == [1, 1, 1]
    # The cached prefix is the first request's KV: the same slots in both rows.
    cached, running = mixed.req_to_token[0], mixed.req_to_token[2]
    assert cached[:10] == running[:10] and len(set(mixed.kv_slots)) == len(mixed.kv_slots)


def test_record_forwards_puts_the_methods_back(engine, steps):
    runner = engine.model_runner
    assert not {"forward", "build_forward_batch"} & set(vars(runner))
    assert "forward" not in vars(runner.attn_backend)


def test_the_mask_is_the_attention_the_backend_computed(steps):
    for step in steps:
        assert mask_error(step, step.mask()) < 1e-5
        everything = torch.ones(step.num_tokens, len(step.kv_slots), dtype=torch.bool)
        assert mask_error(step, everything) > 1e-3  # reading other requests' KV changes the output
    mixed = steps[0]
    errors = attention_errors(mixed, mixed.mask())
    assert errors.shape == (mixed.num_tokens,) and float(errors.max()) < 1e-5


def test_packed_logits_equal_each_request_run_alone(engine, steps):
    engine.run_until_done()
    for step in steps:
        for i in range(step.batch_size):
            engine.flush_cache()
            with record_forwards(engine) as alone:
                engine.generate(input_ids=step.tokens[i], sampling_params={"temperature": 0, "max_new_tokens": 1})
            [one] = alone
            assert one.batch_size == 1 and one.prefix_lens == [0]
            torch.testing.assert_close(one.logits[0], step.logits[i], atol=1e-4, rtol=1e-4)


def test_check_positions_accepts_the_real_positions_and_rejects_wrong_ones(steps, capsys):
    check_positions(true_positions, *steps)
    assert "right for all 2 steps" in capsys.readouterr().out
    from_zero = lambda prefix_lens, extend_lens: [k for n in extend_lens for k in range(n)]  # noqa: E731
    across_the_row = lambda prefix_lens, extend_lens: list(range(sum(extend_lens)))  # noqa: E731
    for wrong in (from_zero, across_the_row):
        with pytest.raises(AssertionError, match="the ForwardBatch has"):
            check_positions(wrong, *steps)


def causal_over_the_row(prefix_lens, extend_lens, rows, slots):
    """Wrong: the packed row as one sequence, token t reads the new tokens 0..t of every request."""
    new = [s for row, p in zip(rows, prefix_lens) for s in row[p:]]
    mask = torch.zeros(len(new), len(slots), dtype=torch.bool)
    for t in range(len(new)):
        mask[t, [slots.index(s) for s in new[: t + 1]]] = True
    return mask


def without_prefix(prefix_lens, extend_lens, rows, slots):
    """Wrong: causal over each request's new tokens, its cached prefix forgotten."""
    mask = attention_mask(prefix_lens, extend_lens, rows, slots)
    t = 0
    for prefix, n, row in zip(prefix_lens, extend_lens, rows):
        for _ in range(n):
            mask[t, [slots.index(s) for s in row[:prefix]]] = False
            t += 1
    return mask


def not_causal(prefix_lens, extend_lens, rows, slots):
    """Wrong: every token reads its request's whole row, later tokens included."""
    mask = torch.zeros(sum(extend_lens), len(slots), dtype=torch.bool)
    t = 0
    for n, row in zip(extend_lens, rows):
        for _ in range(n):
            mask[t, [slots.index(s) for s in row]] = True
            t += 1
    return mask


def rows_order_only(prefix_lens, extend_lens, rows, slots):
    """Wrong: ignores `slots` and assumes the columns come in the order of the rows."""
    first = list(dict.fromkeys(s for row in rows for s in row))
    return attention_mask(prefix_lens, extend_lens, rows, first)


def reads_nothing(prefix_lens, extend_lens, rows, slots):
    """Wrong: no token reads anything (its softmax is over nothing: nan)."""
    return torch.zeros(sum(extend_lens), len(slots), dtype=torch.bool)


def test_check_attention_mask_accepts_the_reference(steps, capsys):
    check_attention_mask(attention_mask, *steps)
    assert "in all 2 steps" in capsys.readouterr().out


@pytest.mark.parametrize("wrong", [causal_over_the_row, without_prefix, not_causal, rows_order_only, reads_nothing])
def test_check_attention_mask_rejects_a_wrong_mask(steps, wrong):
    with pytest.raises(AssertionError, match="off from the backend's"):
        check_attention_mask(wrong, *steps)


def test_check_attention_mask_rejects_a_mask_of_the_wrong_shape(steps):
    def one_column_short(prefix_lens, extend_lens, rows, slots):
        return attention_mask(prefix_lens, extend_lens, rows, slots)[:, :-1]

    with pytest.raises(AssertionError, match="mask of shape"):
        check_attention_mask(one_column_short, *steps)


def test_padding_cost_counts_a_padded_batch_of_the_same_requests(steps):
    mixed, decode = steps
    cost = padding_cost(mixed)
    assert cost.loc["input tokens", "packed"] == 8 and cost.loc["input tokens", "padded"] == 3 * 4
    assert cost.loc["KV entries per layer", "packed"] == sum(mixed.seq_lens)
    assert cost.loc["KV entries per layer", "padded"] == 3 * max(mixed.seq_lens)
    pairs = sum(p + k + 1 for p, n in zip(mixed.prefix_lens, mixed.extend_lens) for k in range(n))
    assert cost.loc["query x KV pairs", "packed"] == pairs
    assert (cost.padding == cost.padded - cost.packed).all()
    assert padding_cost(decode).loc["input tokens", "padding"] == 0


def test_draw_packed_batch_marks_every_pad_cell(steps):
    for step in steps:
        fig = draw_packed_batch(step)
        gids = [p.get_gid() or "" for p in fig.axes[0].patches]
        assert sum(g.startswith("token:") for g in gids) == step.num_tokens
        pads = step.batch_size * max(step.extend_lens) - step.num_tokens
        assert sum(g.startswith("pad:") for g in gids) == pads


def test_draw_req_to_token_has_a_cell_per_position(steps):
    for step in steps:
        gids = [p.get_gid() or "" for p in draw_req_to_token(step).axes[0].patches]
        assert sum(g.startswith("new:") for g in gids) == step.num_tokens
        assert sum(g.startswith("prefix:") for g in gids) == sum(step.prefix_lens)


@pytest.mark.parametrize("columns", ["rows", "slots", "sorted"])
def test_draw_attention_mask_draws_the_pairs_the_backend_attends(steps, columns):
    for step in steps:
        fig = draw_attention_mask(step, columns=columns)
        drawn = fig.labkit_mask
        assert int(drawn.sum()) == int(step.mask().sum())
        assert drawn.shape[1] == (sum(step.seq_lens) if columns == "rows" else len(step.kv_slots))
        if columns == "slots":
            assert torch.equal(drawn, step.mask())
        own = [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("own:")]
        assert len(own) == step.num_tokens
    with pytest.raises(ValueError, match="columns must be one of"):
        draw_attention_mask(steps[0], columns="pages")
