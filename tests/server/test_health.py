"""/health on the real app (tiny model): a burst of probes costs one generation, and probes never
take the queue's capacity from real requests."""

from __future__ import annotations

import asyncio

from inprocess_tiny import MODEL, run_with_server


def test_concurrent_probes_share_one_generation_and_take_no_capacity():
    async def test(server):
        server.tm.max_in_flight = 1  # room for one real request
        probes = [asyncio.create_task(server.client.get("/health")) for _ in range(60)]
        await asyncio.sleep(0.2)  # every probe is waiting on a generation (the scheduler is not turned)
        real = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
        r = await server.serve(server.client.post("/v1/completions", json=real))
        assert r.status_code == 200, r.text
        assert [p.status_code for p in await server.serve(asyncio.gather(*probes))] == [200] * 60
        assert server.tm.metrics.counters["requests_total"] == 2  # the real request and one probe
        await server.serve(server.client.get("/health"))  # answered from the probe's recent success
        assert server.tm.metrics.counters["requests_total"] == 2

    run_with_server(test)
