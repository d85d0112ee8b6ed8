"""Sampling: per-step metadata built from SamplingParams, and the vectorized sampler."""

from kestrel.sample.metadata import SamplingMetadata
from kestrel.sample.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata"]
