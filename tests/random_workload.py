"""A random scheduler workload shared by the memory-accounting tests: requests over shared prefixes
arrive and are aborted at random while the engine steps; every step's KV pool must add up."""

from __future__ import annotations

import random

from labkit import Engine


def run_random_workload(engine: Engine, rng: random.Random, steps: int = 150) -> list[str]:
    """Step `engine` through `steps` steps of random arrivals and aborts, then to the end; check the
    pool's accounting at every step and that every request finished. Returns the request ids."""
    prefixes = [[rng.randrange(3, 256) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    live: list[str] = []
    for step in range(steps):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 30))]
            params = {"max_new_tokens": rng.randrange(1, 40), "ignore_eos": True, "temperature": rng.choice([0, 1.0])}
            live.append(engine.add_request(input_ids=prompt, sampling_params=params))
        if live and rng.random() < 0.05:
            engine.abort(rng.choice(live))
        p = engine.step().pool
        assert p.free + p.evictable + p.protected + p.request_owned == p.total, (step, p)
        assert p.free >= 0 and p.request_owned >= 0
    engine.run_until_done()
    assert set(engine.results) == set(live)
    return live
