"""The offline API: LLM(model).generate(prompts, params) and LLM.chat(messages)."""

import time
from typing import Optional, Sequence, Union

from tqdm.auto import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

Message = dict  # {"role": ..., "content": ...}


class LLM:
    """Batched offline generation.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: Optional[str] = None, *, dtype="auto", device=None, load_format: str = "auto",
                 max_model_len: Optional[int] = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_memory_gb: Optional[float] = None, enable_prefix_caching: bool = True,
                 async_scheduling: bool = True, enforce_eager: bool = False, seed: int = 0):
        config = EngineConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_gb=kv_cache_memory_gb, enable_prefix_caching=enable_prefix_caching,
            async_scheduling=async_scheduling, enforce_eager=enforce_eager, seed=seed,
        )
        self.engine = LLMEngine(model, config, dtype=dtype, device=device, load_format=load_format)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (e.g. one built around an already loaded model)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come back in prompt order.

        All prompts are validated before any is queued, so a bad one raises InvalidRequestError and
        leaves the engine as it was.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        return self._run([(p, self.engine.tokenize(p)) for p in prompts], sampling_params, use_tqdm)

    def chat(self, messages: Union[list[Message], list[list[Message]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the tokenizer's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items = []
        for conv in conversations:
            text = self.render_chat(conv, add_generation_prompt)
            items.append((text, self.engine.tokenize(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm)

    def render_chat(self, conversation: list[Message], add_generation_prompt: bool = True) -> str:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidRequestError("this model has no chat template")
        try:
            return tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja raises many kinds
            raise InvalidRequestError(f"cannot apply the chat template: {e}") from None

    def _run(self, items: list[tuple[PromptType, list[int]]], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise InvalidRequestError(f"{len(params)} sampling params for {len(items)} prompts")
        for (_, ids), p in zip(items, params):  # validate everything before queueing anything
            self.engine.validate(ids, p)
        engine = self.engine
        ids = [engine.add_request(prompt, p, prompt_ids=tok_ids) for (prompt, tok_ids), p in zip(items, params)]
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
                        f"prompt {(engine.scheduler.num_prefill_tokens - prompt0) / elapsed:.0f} tok/s, "
                        f"gen {(engine.generation_tokens - gen0) / elapsed:.0f} tok/s", refresh=False)
        except BaseException:
            for request_id in ids:  # leave nothing behind on Ctrl-C or an error
                if request_id not in finished:
                    engine.abort_request(request_id)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]
