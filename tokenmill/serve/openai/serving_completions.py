"""POST /v1/completions.

One engine request per prompt, each with n samples; choice index = prompt index * n + sample index
(OpenAI's convention). A streamed response sends one chunk per generated token of each choice (its
text may be empty while a possible stop string or an incomplete character is held back, or when the
model has no tokenizer), so clients can time every token. Each choice carries the extension field
`token_ids` (the tokens of that chunk, or all of them), which is the only output of a model
without a tokenizer.

`echo` with `logprobs: N` returns the prompt's logprobs first (SamplingParams.prompt_logprobs = N):
the legacy object then covers the prompt tokens (the first with null logprobs) and the generated
ones, and `text` is prompt + completion. `max_tokens: 0` with `echo` returns only the prompt (the
engine generates one token, which is dropped).
"""

from dataclasses import replace
from typing import Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.serve.async_engine import PromptInfo, PromptTools, RequestAborted, RequestStream
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.serve.openai.errors import APIError, stream_error_event
from tokenmill.serve.openai.protocol import CompletionRequest
from tokenmill.serve.openai.serving_common import (SSE_DONE, ChoiceProgress, EventStreamResponse, OpenAIServing,
                                                         clamp_logprob, now_s, sse, token_str, usage)


def normalize_prompts(prompt) -> list[Union[str, list[int]]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def completion_logprobs(c: CompletionOutput, start: int, end: int, text_offset: int) -> tuple[dict, int]:
    """The legacy logprobs object for tokens [start, end) of a choice; returns it and the next offset."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
        chosen = entry.get(tid)
        text = token_str(tid, chosen) if chosen is not None else f"token_id:{tid}"
        tokens.append(text)
        token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
        top.append({token_str(t, lp): clamp_logprob(lp.logprob) for t, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    lp = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
    return lp, text_offset


def prompt_logprobs_part(token_ids: list[int], first_piece: Optional[str], prompt_lp: Optional[list]
                         ) -> tuple[dict, int]:
    """The legacy logprobs object of an echoed prompt (null logprobs for its first token); returns
    it and the text offset after it."""
    tokens, token_logprobs, top, offsets, text_offset = [], [], [], [], 0
    for i, tid in enumerate(token_ids):
        entry = prompt_lp[i] if prompt_lp is not None and i < len(prompt_lp) else None
        chosen = entry.get(tid) if entry is not None else None
        if chosen is not None:
            text = token_str(tid, chosen)
        else:
            text = first_piece if (i == 0 and first_piece is not None) else f"token_id:{tid}"
        tokens.append(text)
        token_logprobs.append(clamp_logprob(chosen.logprob) if chosen is not None else None)
        top.append({token_str(t, lp): clamp_logprob(lp.logprob) for t, lp in entry.items()} if entry else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, text_offset


def join_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def without_tokens(c: CompletionOutput) -> CompletionOutput:
    """An echo-only choice (max_tokens 0): the generated token dropped."""
    return replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                   cumulative_logprob=0.0 if c.cumulative_logprob is not None else None,
                   finish_reason="length" if c.finish_reason is not None else None, stop_reason=None)


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw_request: Request):
        model, lora_request = self.resolve_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported (leave it unset or equal to n)", param="best_of")
        echo = bool(req.echo)
        echo_only = echo and req.max_tokens == 0  # the prompt alone (the engine makes one token, dropped)
        prompts = normalize_prompts(req.prompt)
        self.check_sequences(len(prompts), req.n, "prompt" if len(prompts) > 1 else "n")
        params = self.request_params(req, raw_request, 1 if echo_only else req.max_tokens, req.logprobs)
        echo_logprobs = echo and req.logprobs is not None
        if echo_logprobs:
            params = replace(params, prompt_logprobs=req.logprobs)
        first_pieces: list[Optional[str]] = []  # each prompt's first token as text (it has no logprob)

        def prepare(tools: PromptTools) -> list[tuple[Optional[str], list[int]]]:  # on a prepare worker
            out = []
            for p in prompts:
                ids = tools.tokenize(p)
                out.append((p if isinstance(p, str) else tools.decode(ids) if echo else None, ids))
                if echo_logprobs:
                    first_pieces.append(tools.decode(ids[:1]))
            return out

        request_id = self.new_id("cmpl")
        stream, infos = await self.submit(prepare, params, request_id, lora_request)
        created = now_s()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._stream(stream, infos, request_id, created, model, req.n, echo, include_usage,
                                  req.logprobs is not None, echo_only, first_pieces)
            return EventStreamResponse(events, on_close=stream.abort)
        finals = await self.collect(stream, raw_request)
        return JSONResponse(self._response(finals, infos, request_id, created, model, req.n, echo,
                                           req.logprobs is not None, echo_only, first_pieces))

    def _response(self, finals: dict[int, RequestOutput], infos: list[PromptInfo], request_id: str, created: int,
                  model: str, n: int, echo: bool, want_logprobs: bool, echo_only: bool = False,
                  first_pieces: Optional[list] = None) -> dict:
        choices, completion_tokens = [], 0
        for pi, info in enumerate(infos):
            for c in finals[pi].outputs:
                c = without_tokens(c) if echo_only else c
                prefix = (info.text or "") if echo else ""
                logprobs = None
                if want_logprobs and echo:
                    head, offset = prompt_logprobs_part(info.token_ids, first_pieces[pi], finals[pi].prompt_logprobs)
                    logprobs = join_logprobs(head, completion_logprobs(c, 0, len(c.token_ids), offset)[0])
                elif want_logprobs:
                    logprobs = completion_logprobs(c, 0, len(c.token_ids), 0)[0]
                choices.append({"index": pi * n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                "token_ids": c.token_ids})
                completion_tokens += len(c.token_ids)
        choices.sort(key=lambda ch: ch["index"])
        prompt_tokens = sum(len(info.token_ids) for info in infos)
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens), "system_fingerprint": None}

    async def _stream(self, stream: RequestStream, infos: list[PromptInfo], request_id: str, created: int,
                      model: str, n: int, echo: bool, include_usage: bool, want_logprobs: bool,
                      echo_only: bool = False, first_pieces: Optional[list] = None):
        progress = ChoiceProgress(len(infos) * n)
        offsets = [0] * (len(infos) * n)
        base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        try:
            async for pi, out in stream:
                for c in out.outputs:
                    c = without_tokens(c) if echo_only else c
                    i = pi * n + c.index
                    new = progress.advance(i, c)
                    if new is None:
                        continue
                    start, end, text = new
                    if echo and start == 0:
                        text = (infos[pi].text or "") + text
                    logprobs: Optional[dict] = None
                    if want_logprobs and echo and start == 0:
                        head, offsets[i] = prompt_logprobs_part(infos[pi].token_ids, first_pieces[pi],
                                                                out.prompt_logprobs)
                        logprobs, offsets[i] = completion_logprobs(c, start, end, offsets[i])
                        logprobs = join_logprobs(head, logprobs)
                    elif want_logprobs:
                        logprobs, offsets[i] = completion_logprobs(c, start, end, offsets[i])
                    chunk = dict(base, choices=[{"index": i, "text": text, "logprobs": logprobs,
                                                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                                 "token_ids": c.token_ids[start:end]}])
                    if include_usage:
                        chunk["usage"] = None
                    yield sse(chunk)
            if include_usage:
                prompt_tokens = sum(len(info.token_ids) for info in infos)
                yield sse(dict(base, choices=[], usage=usage(prompt_tokens, progress.completion_tokens)))
        except RequestAborted:
            return
        except Exception as e:  # the engine died or shut down mid-stream: tell the client in-band
            yield stream_error_event(e)
        yield SSE_DONE
