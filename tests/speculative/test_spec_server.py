"""The server with speculation: /generate's meta_info reports verify steps and accepted drafts, a
stream carries several tokens per verify step and ends with the same text, and /metrics reports the
acceptance rate."""

from __future__ import annotations

import asyncio
import json

from labkit.config import EngineConfig
from labkit.server.inprocess import InProcessServer
from labkit.server.metrics import parse_metrics
from tests.speculative.conftest import FIXED_GAIN

PROMPT = "one two three one two three one two three one two three"


def test_the_server_reports_speculation_in_meta_info_and_metrics(tiny_engine_kwargs):
    async def main():
        server = InProcessServer(EngineConfig(**tiny_engine_kwargs, **FIXED_GAIN, speculative_algorithm="ngram"))
        server.args.enable_metrics = True
        await server.start()
        try:
            params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
            r = await server.serve(server.client.post("/generate", json={"text": PROMPT, "sampling_params": params}))
            assert r.status_code == 200
            meta = r.json()["meta_info"]
            assert meta["completion_tokens"] == 40
            assert meta["spec_verify_ct"] > 0 and 0 < meta["spec_accepted_tokens"] <= meta["spec_draft_tokens"]
            body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
            stream = await server.serve(server.client.post("/v1/completions", json=body | {"stream": True}))
            chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
            plain = await server.serve(server.client.post("/v1/completions", json=body))
            assert "".join(c["choices"][0]["text"] for c in chunks) == plain.json()["choices"][0]["text"]
            assert len(chunks) < 40  # verify steps sent several tokens at once
            metrics_text = (await server.serve(server.client.get("/metrics"))).text
            metrics = {m["name"]: m["value"] for m in parse_metrics(metrics_text)}
            drafted, accepted = metrics["labkit:spec_draft_tokens_total"], metrics["labkit:spec_accepted_tokens_total"]
            assert drafted >= meta["spec_draft_tokens"] and metrics["labkit:spec_verify_steps_total"] > 0
            assert metrics["labkit:spec_accept_rate"] == accepted / drafted
            usage = server.scheduler.pool_usage()
            assert usage.request_owned == 0 and usage.protected == 0 and server.scheduler.drafter.idle()
        finally:
            await server.close()

    asyncio.run(main())
