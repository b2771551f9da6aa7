"""A request as the engine tracks it."""

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # waiting for a KV connector to load its prefix (holds the blocks)
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int  # resolved against the context length
    stop_ids: frozenset  # token ids that end the request (EOS unless ignored, plus stop_token_ids)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # KV computed, or scheduled in an in-flight step
    num_pending: int = 0  # tokens sampled by in-flight steps, not yet seen here
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks of known tokens
    num_registered_blocks: int = 0  # leading blocks already entered in the prefix cache
    num_cached_tokens: int = 0  # prefix-cache hit at first admission (GPU and host tiers together)
    num_host_cached_tokens: int = 0  # of which a KV connector loaded (the host tier)
    num_external_tokens: int = 0  # tokens its connector load in flight brings, past num_cached_gpu
    skip_kv_connector: bool = False  # a connector load failed: recompute instead of loading again
    num_prefill_tokens: int = 0  # tokens known at the last admission (prompt, plus outputs if resumed)
    num_preemptions: int = 0
    stop_reason: Optional[object] = None
    speculates: bool = False  # its decodes verify draft tokens (speculative decoding)
    # Whether the latest proposal seen on the CPU had drafts: a decode schedules 1 + k tokens only
    # then (a request whose lookups find nothing decodes one token, at no extra cost).
    expects_drafts: bool = True
    # Structured output: a grammar constrains it (engine/grammar.py fills its masks)
    structured: bool = False
    # With a grammar and speculation: the drafts its latest step proposed (as the device holds them),
    # which the matcher walks to fill a mask for each draft position of the next verify step
    drafts: list[int] = field(default_factory=list)
    num_uncertain: int = 0  # in-flight steps that verify drafts (how many of their tokens stand is not known yet)
    parent_id: Optional[str] = None  # the user's request id when n > 1
    lora_request: Optional[LoRARequest] = None  # its LoRA adapter, if any (lora/)
    index: int = 0  # which of the n samples

    @property
    def cache_extra(self) -> bytes:
        """What besides the tokens decides this request's KV (engine/block_hash.py's `extra`): its
        adapter, so two adapters never share prefix-cache blocks."""
        lora = self.lora_request
        if lora is None:
            return b""
        return f"lora\0{lora.lora_int_id}\0{lora.lora_name}\0{lora.lora_path}\0".encode()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known on the CPU: prompt plus the outputs seen so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_scheduled_ahead(self) -> int:
        """Known tokens plus those in-flight steps will sample (the scheduler's optimistic count)."""
        return self.num_tokens + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens
