"""What the completions and chat handlers share: model check, sampling parameters, submission,
server-sent events, and following a request to its end while watching for the client leaving."""

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Callable, Optional

from fastapi import Request
from starlette.responses import StreamingResponse

from tokenmill.serve.async_engine import (AsyncLLMEngine, EngineDeadError, EngineOverloadedError, PrepareFn,
                                           PromptInfo, RequestStream, check_encodable)
from tokenmill.engine.outputs import Logprob, RequestOutput
from tokenmill.serve.openai.errors import APIError, echoed
from tokenmill.serve.openai.lora import LoRARegistry
from tokenmill.serve.openai.metrics import ServerMetrics
from tokenmill.serve.openai.protocol import _SamplingFields
from tokenmill.serve.openai.tenants import Tenants
from tokenmill.errors import InvalidRequestError
from tokenmill.lora.request import LoRARequest
from tokenmill.serve.openai.response_format import structured_outputs_of
from tokenmill.sampling_params import SamplingParams

MAX_STOP_STRINGS = 32
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256  # prompts x n in one request
_SEED_MASK = (1 << 63) - 1
_MIN_LOGPROB = -9999.0  # JSON has no -inf


class ClientDisconnected(Exception):
    pass


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], metrics: Optional[ServerMetrics],
                 max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                 loras: Optional[LoRARegistry] = None, tenants: Optional[Tenants] = None):
        self.engine = engine
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.max_sequences_per_request = max_sequences_per_request
        self.loras = loras  # LoRA adapters served by name (None: none)
        self.tenants = tenants or Tenants()  # decides each request's cache salt (by its API key, if so set)

    def model_name(self, requested: Optional[str]) -> str:
        """The served name a request's `model` stands for: a base model's or a LoRA adapter's."""
        return self.resolve_model(requested)[0]

    def resolve_model(self, requested: Optional[str]) -> tuple[str, Optional[LoRARequest]]:
        """The served name and, for a LoRA adapter's name, its LoRARequest; 404 for any other name."""
        if requested is None or requested == "":
            return self.served_model_names[0], None
        if requested in self.served_model_names:
            return requested, None
        module = self.loras.get(requested) if self.loras is not None else None
        if module is not None:
            return requested, module.request
        served = self.served_model_names + (self.loras.names() if self.loras is not None else [])
        raise APIError(404, f"the model `{echoed(requested)}` does not exist; this server serves "
                            f"{', '.join(served)}", param="model", code="model_not_found")

    def check_sequences(self, num_prompts: int, n: int, param: str) -> None:
        """One request may ask for at most max_sequences_per_request sequences (prompts x n)."""
        sequences = num_prompts * n
        if sequences > self.max_sequences_per_request:
            raise APIError(400, f"the request asks for {sequences} sequences ({num_prompts} prompt(s) x n={n}); "
                                f"this server takes at most {self.max_sequences_per_request} per request "
                                "(max_sequences_per_request)", param=param, code="too_many_sequences")

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def request_params(self, req: _SamplingFields, raw_request: Request, max_tokens: Optional[int],
                       logprobs: Optional[int]) -> SamplingParams:
        """sampling_params, with the request's cache salt (the client's, and its API key's if so set)."""
        params = self.sampling_params(req, max_tokens, logprobs)
        params.cache_salt = self.tenants.cache_salt(dict(raw_request.scope.get("headers") or []), params.cache_salt)
        return params

    @staticmethod
    def sampling_params(req: _SamplingFields, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        """Map the OpenAI fields (and extensions) to SamplingParams; raises InvalidRequestError."""
        stop = req.stop
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        for s in [stop] if isinstance(stop, str) else stop or []:
            check_encodable(s, "a stop string")
        seed = None if req.seed is None else req.seed & _SEED_MASK  # any int64/uint64 -> the engine's range
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop or None,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            frequency_penalty=req.frequency_penalty or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            logit_bias=req.logit_bias or None,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            bad_words=req.bad_words,
            allowed_token_ids=req.allowed_token_ids,
            structured_outputs=structured_outputs_of(req),
            cache_salt=req.cache_salt,
        )

    async def submit(self, prepare: PrepareFn, params: SamplingParams, request_id: str,
                     lora_request: Optional[LoRARequest] = None) -> tuple[RequestStream, list[PromptInfo]]:
        """Prepare (on a worker) and queue, with the LoRA adapter if one is given; returns once the
        prompts are validated and queued."""
        if lora_request is None:
            stream = self.engine.submit(prepare, params, request_id)
        else:
            stream = self.engine.submit(prepare, params, request_id, lora_request=lora_request)
        try:
            prompts = await stream.accepted()
        except BaseException as e:
            stream.abort()
            if self.metrics is not None:  # invalid ones are counted with every 400 (errors.install_error_handlers)
                reason = ("overloaded" if isinstance(e, EngineOverloadedError) else "unavailable"
                          if isinstance(e, EngineDeadError) else None)
                if reason:
                    self.metrics.rejected(reason)
            raise
        return stream, prompts

    @staticmethod
    async def collect(stream: RequestStream, raw_request: Request) -> dict[int, RequestOutput]:
        """Follow a non-streamed request to its end; the final output of each prompt, by prompt index.
        A client that disconnects meanwhile aborts the request (and frees its KV blocks)."""
        watcher = asyncio.create_task(_watch_disconnect(raw_request, stream))
        finals: dict[int, RequestOutput] = {}
        try:
            async for index, output in stream:
                if output.finished:
                    finals[index] = output
        except ClientDisconnected:
            raise APIError(499, "the client closed the connection", code="client_closed_request") from None
        finally:
            watcher.cancel()
            stream.abort()  # no-op once finished
        return finals


async def _watch_disconnect(raw_request: Request, stream: RequestStream) -> None:
    try:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                break
    except Exception:
        return
    stream.fail(ClientDisconnected())
    stream.abort()


class EventStreamResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (done, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def now_s() -> int:
    return int(time.time())


def clamp_logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB) if value == value else _MIN_LOGPROB


def token_str(token_id: int, lp: Logprob) -> str:
    """How a token is shown in logprobs; `token_id:N` when the model has no tokenizer (vLLM's form)."""
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChoiceProgress:
    """How much of each streamed choice has been sent: tokens, characters, and whether it finished."""

    def __init__(self, num_choices: int):
        self.tokens = [0] * num_choices
        self.chars = [0] * num_choices
        self.done = [False] * num_choices
        self.completion_tokens = 0

    def advance(self, i: int, output) -> Optional[tuple[int, int, str]]:
        """(first new token, end, new text) of choice i in this cumulative output, or None if nothing
        new is there to send."""
        if self.done[i]:
            return None
        start, end = self.tokens[i], len(output.token_ids)
        if end == start and output.finish_reason is None:
            return None
        text = output.text[self.chars[i]:]
        self.chars[i] = max(self.chars[i], len(output.text))
        self.tokens[i] = end
        self.completion_tokens += end - start
        self.done[i] = output.finish_reason is not None
        return start, end, text

