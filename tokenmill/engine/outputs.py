"""What generation returns to users."""

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: Optional[str] = None


# For each generated token: {token_id: Logprob} for the sampled token and the top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# For each prompt token: None for the first, then {token_id: Logprob} for the token and the top-k.
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop", "length" or "abort"
    stop_reason: Union[None, int, str] = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_prompt_tokens: int = 0  # prompt tokens not computed: prefix-cache hits, all tiers
    # of those, loaded by a KV connector: the host tier (kv_offloading_size), or the prefill engine (P/D)
    num_host_cached_prompt_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = field(default=None, repr=False)
    prompt_logprobs: Optional[PromptLogprobs] = None  # with SamplingParams.prompt_logprobs
