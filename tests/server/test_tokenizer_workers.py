"""Several tokenizer workers (--tokenizer-worker-num): each message names its worker and comes back
to it; the detokenizer keeps the workers' requests apart; the workers answer each other's questions
(an abort by id, stats); the queue cap is shared out. The real server with two workers is in
test_tokenizer_workers_server.py."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest
import zmq

from labkit.io_struct import (
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizeParams,
    GenerateReqInput,
    ReqOutput,
    ToScheduler,
)
from labkit.scheduler.limits import RequestLimits
from labkit.server.detokenizer_process import DetokenizerLoop
from labkit.server.ipc import ENCODER, PortArgs, pull_socket, push_socket
from labkit.server.metrics import ServerMetrics
from labkit.server.runtime import make_tokenizer_manager
from labkit.server.server_args import ServerArgs
from labkit.server.tokenizer_manager import TokenizerManager
from labkit.tokenizer.detokenizer_manager import DetokenizerManager

INFO = {"limits": dataclasses.asdict(RequestLimits(vocab_size=1000, context_len=512, max_total_tokens=4096))}


@pytest.fixture
def ports():
    p = PortArgs.create()
    yield p
    p.cleanup()


def recv_all(sock: zmq.Socket, decoder, timeout_ms: int = 2000) -> list:
    out = []
    while sock.poll(timeout_ms):
        out.append(decoder.decode(sock.recv()))
        timeout_ms = 100
    return out


def test_the_detokenizer_sends_each_output_to_its_worker_and_keeps_same_rids_apart(ports, hf_tokenizer):
    ctx = zmq.Context()
    inbox = [pull_socket(ctx, ports.tokenizer_ipc_of(w)) for w in range(2)]
    loop = DetokenizerLoop(DetokenizerManager(hf_tokenizer), ports, workers=2)
    params = DetokenizeParams(stop=[], skip_special_tokens=True, spaces_between_special_tokens=True)
    hello, world = hf_tokenizer.encode(" Hello there"), hf_tokenizer.encode(" brave new world")
    first = [
        ReqOutput(rid="same", token_ids=hello[:1], worker=0, detokenize=params),
        ReqOutput(rid="same", token_ids=world[:1], worker=1, detokenize=params),
    ]
    rest = [
        ReqOutput(rid="same", token_ids=world[1:], worker=1, finish_reason={"type": "length"}),
        ReqOutput(rid="same", token_ids=hello[1:], worker=0, finish_reason={"type": "length"}),
    ]
    try:
        for outputs in (first, rest):
            loop.handle(ENCODER.encode(BatchTokenIDOutput(outputs=outputs, step=1)))
        decoder = msgspec.msgpack.Decoder(BatchStrOutput)
        got = [recv_all(sock, decoder) for sock in inbox]
        for worker, text in ((0, " Hello there"), (1, " brave new world")):
            outs = [o for batch in got[worker] for o in batch.outputs]
            assert {o.worker for o in outs} == {worker}
            assert "".join(o.text for o in outs) == text
        assert loop.manager.decode_status == {}  # both finished: nothing kept
    finally:
        loop.close()
        ctx.destroy(linger=0)


def make_workers(ports: PortArgs, n: int) -> list[TokenizerManager]:
    return [TokenizerManager(None, ports, INFO, None, worker=w, workers=n) for w in range(n)]


def test_rids_aborts_and_stats_span_the_workers(ports):
    async def main():
        scheduler = pull_socket(zmq.Context.instance(), ports.scheduler_ipc)
        detokenizer = push_socket(zmq.Context.instance(), ports.tokenizer_ipc_of(2))  # as it would send
        decoder = msgspec.msgpack.Decoder(ToScheduler)
        tms = make_workers(ports, 3)
        loops = [asyncio.create_task(tm.handle_loop()) for tm in tms]
        try:
            req = GenerateReqInput(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4}, rid="r")
            [state] = await tms[2].submit([req])
            [sent] = recv_all(scheduler, decoder)
            assert (sent.rid, sent.worker) == ("r", 2)  # the scheduler learns whose it is
            # A client-given rid is unique across the workers: the others refuse it while in flight.
            with pytest.raises(ValueError, match="already in use"):
                await tms[0].submit([req])

            # Worker 0 is asked to abort "r": worker 2 sends the AbortReq, and once the scheduler's
            # abort reaches it (routed by the output's worker), worker 0 names it.
            abort = asyncio.create_task(tms[0].abort("r"))
            [msg] = await asyncio.to_thread(recv_all, scheduler, decoder)
            assert msg == AbortReq(rid="r")
            out = ReqOutput(rid="r", token_ids=[], worker=2, finish_reason={"type": "abort", "message": "aborted"})
            detokenizer.send(ENCODER.encode(BatchStrOutput(outputs=[out])))
            assert await abort == ["r"]
            assert state.finished and state.finish_reason["type"] == "abort"
            assert await tms[1].abort("nobody") == []
            await tms[1].submit([req])  # "r" is free again once it finished
            assert recv_all(scheduler, decoder)[0].worker == 1

            stats = await tms[1].all_stats()
            assert [s["worker"] for s in stats] == [1, 0, 2]
            assert [s["metrics"]["counters"]["aborted_requests_total"] for s in stats] == [0, 0, 1]
        finally:
            for task in loops:
                task.cancel()
            for tm in tms:
                tm.close()
            scheduler.close(linger=0)
            detokenizer.close(linger=0)

    asyncio.run(main())


def test_the_metrics_of_every_worker_add_up():
    a, b = ServerMetrics(), ServerMetrics()
    a.inc("requests_total", 3)
    b.inc("requests_total", 4)
    a.ttft.observe(0.003)
    b.ttft.observe(0.3)
    b.ttft.observe(0.3)
    total = ServerMetrics.total([a.snapshot(), b.snapshot()])
    assert total.counters["requests_total"] == 7
    assert sum(total.ttft.counts) == 3 and total.ttft.sum == pytest.approx(0.603)
    assert total.ttft.counts[0] == 1
    assert "labkit:requests_total 7" in total.render({})


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
def test_the_queue_cap_is_shared_out_among_the_workers(ports, workers):
    args = ServerArgs.from_cli(["--max-running-requests", "8", "--max-queued-requests", "5"])
    args.tokenizer_worker_num = workers
    tms = [make_tokenizer_manager(args, None, ports, INFO, w) for w in range(workers)]
    try:
        caps = [tm.max_in_flight for tm in tms]
        assert sum(caps) == 13 and max(caps) - min(caps) <= 1
    finally:
        for tm in tms:
            tm.close()


@pytest.mark.parametrize(
    "argv",
    [["--tokenizer-worker-num", "0"], ["--tokenizer-worker-num", "2", "--trace-file", "t.json"]],
)
def test_bad_tokenizer_worker_options_are_refused(argv):
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(argv)
