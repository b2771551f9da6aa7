"""The offline API: LLM(model).generate(prompts, params) and LLM.chat(messages)."""

import dataclasses
import difflib
import inspect
import sys
import time
import typing
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from tokenmill.chat_template import render_chat
from tokenmill.config import EngineConfig, LoadConfig, field_default
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import InvalidRequestError
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

Message = dict  # {"role": ..., "content": ...}



def _option_fields() -> list[tuple[type, dataclasses.Field]]:
    return [(cls, f) for cls in (LoadConfig, EngineConfig) for f in dataclasses.fields(cls)]


def configs_from_kwargs(model: Optional[str], kwargs: dict) -> tuple[LoadConfig, EngineConfig]:
    """LoadConfig and EngineConfig from keywords named after their fields; an unknown keyword is a
    TypeError naming it (and the closest option), a bad value a ConfigError."""
    names = {f.name: cls for cls, f in _option_fields()}
    for key in kwargs:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"LLM() got an unexpected keyword argument {key!r}{hint}")
    load = LoadConfig(model=model, **{k: v for k, v in kwargs.items() if names[k] is LoadConfig})
    return load, EngineConfig(**{k: v for k, v in kwargs.items() if names[k] is EngineConfig})


def _local_model(load: LoadConfig) -> Optional[str]:
    from tokenmill.loader.hub import local_model

    return local_model(load.model, load.load_format, load.revision, load.download_dir)


def _signature() -> inspect.Signature:
    """LLM(model=None, *, <every LoadConfig and EngineConfig field with its default>), for help() and IDEs."""
    hints = {**typing.get_type_hints(LoadConfig), **typing.get_type_hints(EngineConfig)}
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for _, f in _option_fields():
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model" else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=field_default(f), annotation=hints[f.name]))
    return inspect.Signature(params)


def format_rate(tokens: int, seconds: float) -> str:
    """A token rate as the progress bar shows it: "1234 tok/s", "3.5 tok/s", "0.4 tok/s", or
    "12.5 s/tok" below 0.1 tok/s (a rate under 1 never reads as 0)."""
    rate = tokens / seconds if seconds > 0 else 0.0
    if rate >= 10 or tokens == 0:
        return f"{rate:.0f} tok/s"
    if rate >= 0.1:
        return f"{rate:.1f} tok/s"
    return f"{1 / rate:.1f} s/tok"


class LLM:
    """Batched offline generation.

    `LLM(model, **options)` takes every field of LoadConfig (load_format, dtype, device) and of
    EngineConfig (max_model_len, max_num_seqs, ...) as a keyword, with the same defaults as the
    command line's flags (tokenmill/config.py has them all, with their help).

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any):
        load, config = configs_from_kwargs(model, kwargs)
        self._owns_engine = False  # set first: __del__ runs even when the engine fails to build
        self.engine = LLMEngine(_local_model(load), config, dtype=load.dtype, device=load.device,
                                load_format=load.load_format, tokenizer=load.tokenizer)
        self._owns_engine = True

    __init__.__signature__ = _signature()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (e.g. one built around an already loaded model); shutdown() and
        deleting the LLM leave that engine to its owner."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._owns_engine = False
        return llm

    @property
    def llm_engine(self) -> LLMEngine:
        return self.engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The tokenizer prompts are encoded with (None for a dummy preset without one)."""
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Release the model, the KV cache, CUDA graphs and workers now (idempotent); the LLM cannot
        generate afterwards. Deleting the last reference to an LLM does the same."""
        if self.__dict__.get("_owns_engine"):
            self._owns_engine = False
            self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def __del__(self) -> None:
        # Only when this LLM is the engine's last holder (a caller may keep `llm.llm_engine`):
        # two references, the attribute's and getrefcount's argument.
        engine = self.__dict__.get("engine")
        if engine is None or sys.getrefcount(engine) > 3:  # + this local
            return
        del engine
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 -- at interpreter exit the modules it needs may be gone
            pass

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True,
                 lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come back in prompt order.
        lora_request: one LoRA adapter for every prompt, or a list with one per prompt (None: the
        base model); needs enable_lora=True.

        All prompts (and adapters) are validated before any is queued, so a bad one raises
        InvalidRequestError (LoRAError for an adapter) and leaves the engine as it was.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        return self._run([(p, self.engine.tokenize(p)) for p in prompts], sampling_params, use_tqdm, lora_request)

    def chat(self, messages: Union[list[Message], list[list[Message]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: Optional[str] = None,
             chat_template_kwargs: Optional[dict[str, Any]] = None,
             tools: Optional[list[dict[str, Any]]] = None,
             lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the tokenizer's chat template (or
        `chat_template`, a Jinja string), which also gets `chat_template_kwargs` as variables.

        `tools` (OpenAI's `[{"type": "function", "function": {...}}]`) reach the template; one that
        does not use them gets them described in the system message in the hermes format instead
        (serve/openai/tools.py), as do assistant `tool_calls` and `role: "tool"` messages. The
        output is text: reading calls out of it is the server's (or the caller's) business.
        lora_request: as for generate().
        """
        from tokenmill.serve.openai.tools import parse_tools, template_conversation

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        function_tools = parse_tools(tools)
        template = chat_template or getattr(self.engine.tokenizer, "chat_template", None)
        items = []
        for conv in conversations:
            conv, tool_dicts = template_conversation(list(conv), function_tools, template, None)
            text = self.render_chat(conv, add_generation_prompt, chat_template=chat_template,
                                    chat_template_kwargs=chat_template_kwargs, tools=tool_dicts)
            items.append((text, self.engine.tokenize(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm, lora_request)

    def render_chat(self, conversation: list[Message], add_generation_prompt: bool = True,
                    chat_template: Optional[str] = None, chat_template_kwargs: Optional[dict[str, Any]] = None,
                    tools: Optional[list[dict[str, Any]]] = None) -> str:
        """The conversation as prompt text (tokenmill/chat_template.py); InvalidRequestError if it cannot render."""
        return render_chat(self.engine.tokenizer, conversation, add_generation_prompt, chat_template=chat_template,
                           chat_template_kwargs=chat_template_kwargs, tools=tools)

    def _run(self, items: list[tuple[PromptType, list[int]]], sampling_params, use_tqdm: bool,
             lora_request=None) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise InvalidRequestError(f"{len(params)} sampling params for {len(items)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(items)
        else:
            loras = list(lora_request)
            if len(loras) != len(items):
                raise InvalidRequestError(f"{len(loras)} LoRA requests for {len(items)} prompts")
            bad = [x for x in loras if x is not None and not isinstance(x, LoRARequest)]
            if bad:
                raise InvalidRequestError(f"lora_request must be a LoRARequest or None, got {bad[0]!r}")
        for (_, ids), p in zip(items, params):  # validate everything before queueing anything
            self.engine.validate(ids, p)
        for lora in dict.fromkeys(x for x in loras if x is not None):
            self.engine.add_lora(lora)
        engine = self.engine
        ids = [engine.add_request(prompt, p, prompt_ids=tok_ids, lora_request=lora)
               for (prompt, tok_ids), p, lora in zip(items, params, loras)]
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        started, prompt0, gen0 = time.perf_counter(), engine.scheduler.num_prefill_tokens, engine.generation_tokens
        try:
            while len(finished) < len(ids):
                for out in engine.step(emit_unfinished=False):
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
                if use_tqdm:
                    elapsed = max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix_str(
                        f"prompt {format_rate(engine.scheduler.num_prefill_tokens - prompt0, elapsed)}, "
                        f"gen {format_rate(engine.generation_tokens - gen0, elapsed)}", refresh=False)
        except BaseException:
            for request_id in ids:  # leave nothing behind on Ctrl-C or an error
                if request_id not in finished:
                    engine.abort_request(request_id)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        finally:
            bar.close()
        while engine.has_unfinished_requests():  # a step launched before its requests finished
            engine.step(emit_unfinished=False)
        return [finished[i] for i in ids]
