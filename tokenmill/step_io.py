"""Messages between the engine and the runner, below both (the engine builds SchedulerOutput; the runner answers
with ModelRunnerOutput through an AsyncOutput). Plain typed dataclasses: no layer above is imported."""

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from tokenmill.kv_connector.base import KVConnectorMetadata
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request entering the runner (first admission, or again after preemption)."""

    req_id: str
    token_ids: list[int]  # everything known: the prompt, plus earlier outputs when resumed
    num_prompt_tokens: int  # the original prompt's length (penalties tell prompt from output)
    params: SamplingParams
    seed: int
    block_ids: list[int]
    # Token ids masked while fewer than min_tokens have been generated (EOS unless ignored + stop ids).
    min_tokens_stop_ids: list[int] = field(default_factory=list)
    lora_request: Optional[LoRARequest] = None  # the request's adapter (lora/), if any


@dataclass
class ScheduledRequest:
    """One entry of a step's batch."""

    req_id: str
    num_tokens: int  # new tokens computed this step
    start_pos: int  # tokens already in the KV cache (or computed by earlier in-flight steps)
    new_block_ids: list[int]  # appended to the request's block table before this step
    samples: bool  # this step reaches the end of the known tokens, so it samples the next one
    # A speculating request's decode: its last sampled token and up to num_tokens - 1 drafts. Its
    # position comes from the device (start_pos is the scheduler's upper bound, since in-flight
    # steps may accept fewer drafts); its KV slots are reserved for all of them.
    speculative: bool = False


@dataclass
class GrammarBitmask:
    """Structured output: the packed token masks of a step's entries that have a grammar (the engine
    fills them; the runner applies them before sampling). Row i belongs to req_ids[i], for that
    request's logits row offsets[i] of the step (0 but in a verify step, where row j follows the
    first j drafts); bit j of int32 word w allows token 32 w + j."""

    req_ids: list[str]
    mask: np.ndarray  # [len(req_ids), ceil(vocab / 32)] int32
    offsets: Optional[np.ndarray] = None  # [len(req_ids)] int64; None: all 0


@dataclass
class SchedulerOutput:
    batch: list[ScheduledRequest]
    new_requests: list[NewRequestData] = field(default_factory=list)
    freed_req_ids: list[str] = field(default_factory=list)  # rows to release before this step
    num_decodes: int = 0  # entries whose prompt was already done (the rest prefill a chunk)
    kv_connector_metadata: Optional[KVConnectorMetadata] = None  # the step's KV transfers (kv_connector/)

    @property
    def kind(self) -> str:
        """decode (every entry decodes), prefill (none does) or mixed."""
        if self.num_decodes == len(self.batch):
            return "decode"
        return "prefill" if self.num_decodes == 0 else "mixed"

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.batch)


@dataclass
class LogprobsArrays:
    """A step's logprobs on the host, in batch order (the runner computes them as tensors and
    copies them back with the sampled tokens)."""

    token_logprobs: np.ndarray  # [B] float32: the sampled token's logprob
    token_ranks: np.ndarray  # [B] int64
    top_ids: np.ndarray  # [B, k] int64
    top_logprobs: np.ndarray  # [B, k] float32


@dataclass
class PromptLogprobsSpan:
    """Prompt positions [start, start + count) of one request, rows [offset, offset + count) of the
    step's PromptLogprobsArrays.rows: row j holds the logprob of prompt token start + j + 1."""

    req_id: str
    start: int
    count: int
    offset: int


@dataclass
class PromptLogprobsArrays:
    """A prefill step's prompt logprobs on the host, for the requests that asked."""

    spans: list[PromptLogprobsSpan]
    rows: LogprobsArrays  # token_logprobs / token_ranks: the actual next prompt token's


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # batch order
    sampled_token_ids: np.ndarray  # [B] int64, or [B, 1 + k] with speculation; -1 where nothing was sampled
    logprobs: Optional[LogprobsArrays] = None
    num_emitted: Optional[np.ndarray] = None  # [B] tokens each entry emitted (speculation: 1 + accepted)
    num_drafts: Optional[np.ndarray] = None  # [B] drafts each entry verified (speculation)
    next_num_drafts: Optional[np.ndarray] = None  # [B] drafts proposed for each entry's next step (speculation)
    # [B, k] the proposed drafts themselves (-1 past next_num_drafts): only in steps with a grammar
    # request (structured output walks its matcher through them), else None.
    next_draft_ids: Optional[np.ndarray] = None
    prompt_logprobs: Optional[PromptLogprobsArrays] = None  # prefill steps where a request asked
