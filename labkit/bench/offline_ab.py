"""The offline workload under several settings, alternated in one process (batch1_ab's method for
offline_gpu's 256-request run): separate runs on these GPU hosts differ by more than most changes.

    python -m labkit.bench.offline_ab [--model qwen3-0.6b] [--rounds 5] [--kv-memory-gb 32] \\
        [--kv-cache-dtype fp8_e4m3] [offline_gpu's workload and engine options] \\
        --variant base \\
        --variant stages-3:labkit.kernels.decode.FP8_NUM_STAGES=3

Every variant gets its own engine (offline_gpu's, random weights, warmed up as offline_gpu warms
its one), all alive at once: --kv-memory-gb is each one's pool, so variants x that must fit the GPU
(the default 256-request workload peaks near 290k tokens, 32 GB of Qwen3-0.6B bf16 KV). Each round
runs the whole workload on every engine, the order rotating, the prefix cache flushed before each run.
Reported: output tokens/s per variant, median (range), and the median per-round difference from the
first variant.
"""

from __future__ import annotations

import json

from labkit import Engine
from labkit.bench import offline_gpu
from labkit.bench.batch1_ab import compare, parse_variants


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = offline_gpu.arg_parser()
    ap.description = __doc__
    ap.add_argument("--variant", action="append", required=True, help="name[:module.NAME=value,...]; repeat")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    variants = parse_variants(ap, args.variant)
    vocab = json.loads((offline_gpu.CONFIGS_DIR / f"{args.model}.json").read_text())["vocab_size"]
    prompts, out_lens = offline_gpu.make_workload(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)

    def build() -> Engine:
        engine = offline_gpu.build_engine(args.model, args, disable_overlap_schedule=args.disable_overlap_schedule)
        offline_gpu.warm_up(engine, args, vocab)
        return engine

    def tokens_per_second(engine: Engine) -> float:
        engine.flush_cache()
        return sum(out_lens) / offline_gpu.run_workload(engine, prompts, out_lens)

    title = f"offline {args.model}, {len(prompts)} requests, KV {args.kv_cache_dtype}"
    return compare(variants, build, tokens_per_second, args.rounds, title, "tok/s", 0)


if __name__ == "__main__":
    main()
