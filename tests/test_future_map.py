"""FutureMap: the overlap-scheduling protocol (future tokens, their device table, the host copy)."""

from __future__ import annotations

import torch

from labkit.model_executor.future_map import FutureMap, HostSample
from labkit.sampling.sampler import SampleOutput


def test_future_tokens_are_negative_distinct_per_slot_and_recognized():
    tokens = [FutureMap.future_token(slot) for slot in range(5)]
    assert len(set(tokens)) == 5 and all(FutureMap.is_future(t) for t in tokens)
    assert not FutureMap.is_future(0) and not FutureMap.has_future([0, 7, 3])
    assert FutureMap.has_future([5, tokens[2], 9])


def test_resolve_replaces_future_tokens_with_their_slots_stored_token_and_keeps_real_ids():
    fmap = FutureMap(4, torch.device("cpu"))
    host = fmap.store(torch.tensor([3, 1]), SampleOutput(torch.tensor([42, 17]), None, None))
    assert host.wait().next_token_ids.tolist() == [42, 17]
    ids = torch.tensor([5, FutureMap.future_token(1), 0, FutureMap.future_token(3)])
    assert fmap.resolve(ids).tolist() == [5, 17, 0, 42]
    fmap.store(torch.tensor([1]), SampleOutput(torch.tensor([8]), None, None))  # the slot's next token
    assert fmap.resolve(torch.tensor([FutureMap.future_token(1)])).tolist() == [8]


def test_a_host_sample_off_cuda_is_the_output_itself():
    out = SampleOutput(torch.tensor([1, 2]), torch.tensor([-0.5, -1.0]), None)
    sample = HostSample.start(out)
    assert sample.event is None and sample.wait() is out
