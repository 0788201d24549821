"""/abort_request on the real app (tiny model): an exact rid, or an OpenAI response id for its own
choices, never a prefix of other clients' rids; the answer names only what the scheduler aborted."""

from __future__ import annotations

import asyncio

from inprocess_tiny import MODEL, run_with_server

LONG = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 48, "ignore_eos": True, "temperature": 0}


async def in_flight(server, count: int) -> list[str]:
    """The rids in flight, once `count` of them are."""
    while len(server.tm.rid_to_state) < count:
        await asyncio.sleep(0.001)
    return sorted(server.tm.rid_to_state)


def finishes(response) -> list[str]:
    return [c["finish_reason"] for c in response.json()["choices"]]


def test_a_prefix_aborts_nothing_and_a_response_id_aborts_its_own_choices():
    async def test(server):
        one = asyncio.create_task(server.client.post("/v1/completions", json=LONG))
        [rid_one] = await in_flight(server, 1)
        two = asyncio.create_task(server.client.post("/v1/completions", json={**LONG, "n": 2}))
        rids_two = [r for r in await in_flight(server, 3) if r != rid_one]
        response_two = rids_two[0].rsplit("-", 1)[0]
        for prefix in ("cmpl", "cmpl-", rid_one[:-1], response_two[:-1]):
            r = await server.client.post("/abort_request", json={"rid": prefix})
            assert r.status_code == 200 and r.json() == {"aborted": []}
        r = await server.serve(server.client.post("/abort_request", json={"rid": response_two}))
        assert sorted(r.json()["aborted"]) == rids_two
        first, second = await server.serve(asyncio.gather(one, two))
        assert finishes(first) == ["length"] and finishes(second) == ["abort", "abort"]

    run_with_server(test)


def test_a_request_that_finished_first_is_not_reported_aborted():
    async def test(server):
        task = asyncio.create_task(server.client.post("/v1/completions", json={**LONG, "max_tokens": 1}))
        _, msg = await server.next_message()
        server.scheduler_loop.process_input_request(msg)
        server.scheduler_loop.send_outputs(server.scheduler.step())  # its one token: finished in the scheduler
        assert msg.rid in server.tm.rid_to_state  # its finish has not reached the TokenizerManager yet
        r = await server.serve(server.client.post("/abort_request", json={"rid": msg.rid}))
        assert r.json() == {"aborted": []}
        assert finishes(await server.serve(task)) == ["length"]

    run_with_server(test)


# EOS ignored: a random model's early EOS would finish it before the abort arrives (seen once in CI-like runs).
MINE = {"input_ids": [1, 2], "rid": "mine", "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}


def test_an_exact_rid_is_aborted_and_reported():
    async def test(server):
        task = asyncio.create_task(server.client.post("/generate", json=MINE))
        await in_flight(server, 1)
        r = await server.serve(server.client.post("/abort_request", json={"rid": "mine"}))
        assert r.json() == {"aborted": ["mine"]}
        assert (await server.serve(task)).json()["meta_info"]["finish_reason"] == "abort"

    run_with_server(test)
