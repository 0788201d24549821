"""`python -m labkit`: a one-line demo of the engine on the embedded model (`python -m labkit.server` serves it)."""

import time

from labkit import Engine


def main() -> None:
    start = time.perf_counter()
    engine = Engine()
    loaded = time.perf_counter()
    question = "What is the capital of France?"
    out = engine.generate(
        messages=[{"role": "user", "content": question}], sampling_params={"temperature": 0, "max_new_tokens": 48}
    )
    assert isinstance(out, dict)  # one conversation in, one result out (generate's type covers batches too)
    meta = out["meta_info"]
    runner = engine.model_runner
    print(
        f"labkit demo ({runner.device}, {runner.dtype}, model loaded in {loaded - start:.1f}s): {question!r} -> "
        f"{out['text']!r} [{meta['completion_tokens']} tokens, {meta['e2e_latency']:.2f}s, "
        f"finish={meta['finish_reason']['type']}]"
    )


if __name__ == "__main__":
    main()
