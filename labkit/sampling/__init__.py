"""Sampling: per-request parameters, per-step batch tensors, and the sampler."""

from labkit.sampling.penalties import Penalties, SamplingReq
from labkit.sampling.sampler import SampleOutput, Sampler, SamplingBatchInfo
from labkit.sampling.sampling_params import SamplingParams

__all__ = ["Penalties", "SampleOutput", "Sampler", "SamplingBatchInfo", "SamplingParams", "SamplingReq"]
