"""The sampler and its stages: each stage a module owning its per-request rows, behind SamplingStage."""

from tokenmill.runner.sample.logprobs import DeviceLogprobs
from tokenmill.runner.sample.sampler import Sampler, SamplerOutput
from tokenmill.runner.sample.stage import SampleBatch, SamplingStage

__all__ = ["DeviceLogprobs", "SampleBatch", "Sampler", "SamplerOutput", "SamplingStage"]
