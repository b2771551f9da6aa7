"""EngineClient: what the serving layer asks of an engine, declared once. LLMEngine (in process),
serve/core_client.EngineCoreClient (the engine in its own process) and serve/dp_client.DPEngineClient
(data-parallel replicas) implement it; AsyncLLMEngine and the API server see only this."""

from typing import Any, Optional, Protocol, runtime_checkable

from tokenmill.engine.engine_snapshot import EngineSnapshot
from tokenmill.engine.grammar import StructuredOutputManager
from tokenmill.engine.outputs import RequestOutput
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Any  # the HF tokenizer, or None for token-id-only models
    model_name: str
    max_model_len: int
    vocab_size: int
    structured: StructuredOutputManager  # compiles grammars (thread-safe) for validation before queuing
    steps_completed: int  # steps whose results came back
    last_step_kind: Optional[str]
    outputs: Any  # its `detokenize` flag: AsyncLLMEngine turns it off and makes the text on its own thread

    def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]: ...

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The request's max_tokens once valid; InvalidRequestError naming the problem otherwise."""

    def add_request(self, prompt, params: SamplingParams, request_id: str, prompt_ids: list[int],
                    lora_request: Optional[LoRARequest] = None) -> str: ...

    def abort_request(self, request_id: str, sample: Optional[int] = None) -> Optional[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def num_waiting_sequences(self) -> int: ...

    def step(self) -> list[RequestOutput]: ...

    def snapshot(self) -> EngineSnapshot: ...

    def take_gc_pauses(self) -> list[tuple[int, float]]: ...

    def reset_prefix_cache(self) -> bool: ...

    def add_lora(self, lora_request: LoRARequest) -> None: ...

    def remove_lora(self, lora_int_id: int) -> bool: ...

    def list_loras(self) -> list[int]: ...

    def check_health(self) -> None:
        """Raise EngineDeadError (serving) or return: called before accepting work."""

    def close(self) -> None: ...


ENGINE_CLIENT_METHODS = tuple(name for name in dir(EngineClient)
                              if not name.startswith("_") and callable(getattr(EngineClient, name)))
