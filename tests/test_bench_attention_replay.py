"""labkit.bench.attention_replay: the replay covers the run's decode steps and their KV bytes."""

from __future__ import annotations

import json

from labkit.bench import attention_replay, offline_gpu


def test_decode_steps_hold_the_requests_still_decoding_with_their_kv():
    # request 0: 3 prompt tokens, 4 output tokens (the first from prefill: 3 decode steps)
    assert attention_replay.decode_steps([3, 5], [4, 2]) == [[4, 6], [5], [6]]


def test_replay_counts_every_decode_step_and_its_kv_once():
    argv = ["--model", "tiny-llama", "--num-seqs", "3", "--min-len", "4", "--max-len", "9", "--every", "2"]
    argv += ["--variant", "base", "--variant", "batch-order:labkit.kernels.decode.LONGEST_FIRST=False"]
    results = attention_replay.main(argv)
    config = json.loads((offline_gpu.CONFIGS_DIR / "tiny-llama.json").read_text())
    prompts, out_lens = offline_gpu.make_workload(3, 4, 9, config["vocab_size"], 0)
    steps = attention_replay.decode_steps([len(p) for p in prompts], out_lens)
    assert set(results) == {"base", "batch-order"}
    for replay in results.values():
        total = replay.total
        assert total.steps == len(steps) and total.seconds > 0
        # the timed steps (every 2nd) stand for themselves and the next: their KV counted twice
        timed = [sum(lens) * min(2, len(steps) - t) for t, lens in enumerate(steps) if t % 2 == 0]
        per_token = config["num_key_value_heads"] * (config["hidden_size"] // config["num_attention_heads"]) * 2 * 4
        assert total.kv_bytes == sum(timed) * per_token * config["num_hidden_layers"]
        assert sum(b.steps for b in replay.buckets.values()) == len(steps)
