"""The sampler and its stages: each stage a module owning its per-request rows, behind SamplingStage."""

from tokenmill.runner.sample.logprobs import DeviceLogprobs
from tokenmill.runner.sample.rejection import RejectionOutput, RejectionSampler
from tokenmill.runner.sample.sampler import ProcessedLogits, Sampler, SamplerOutput
from tokenmill.runner.sample.stage import SampleBatch, SamplingStage

__all__ = ["DeviceLogprobs", "ProcessedLogits", "RejectionOutput", "RejectionSampler", "SampleBatch", "Sampler",
           "SamplerOutput", "SamplingStage"]
