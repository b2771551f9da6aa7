"""POST /v1/completions.

One engine request per prompt, each with n samples; choice index = prompt index * n + sample index
(OpenAI's convention). A streamed response sends one chunk per generated token of each choice (its
text may be empty while a possible stop string or an incomplete character is held back, or when the
model has no tokenizer), so clients can time every token. Each choice carries the extension field
`token_ids` (the tokens of that chunk, or all of them), which is the only output of a model
without a tokenizer.
"""

from typing import Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.engine.async_engine import PromptInfo, PromptTools, RequestAborted, RequestStream
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.entrypoints.openai.errors import APIError, stream_error_event
from tokenmill.entrypoints.openai.protocol import CompletionRequest
from tokenmill.entrypoints.openai.serving_common import (SSE_DONE, ChoiceProgress, EventStreamResponse, OpenAIServing,
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


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw_request: Request):
        model = self.model_name(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported (leave it unset or equal to n)", param="best_of")
        echo = bool(req.echo)
        if echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs needs prompt logprobs, which this server does not compute",
                           param="echo")
        prompts = normalize_prompts(req.prompt)
        self.check_sequences(len(prompts), req.n, "prompt" if len(prompts) > 1 else "n")
        params = self.sampling_params(req, req.max_tokens, req.logprobs)

        def prepare(tools: PromptTools) -> list[tuple[Optional[str], list[int]]]:  # on a prepare worker
            out = []
            for p in prompts:
                ids = tools.tokenize(p)
                out.append((p if isinstance(p, str) else tools.decode(ids) if echo else None, ids))
            return out

        request_id = self.new_id("cmpl")
        stream, infos = await self.submit(prepare, params, request_id)
        created = now_s()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._stream(stream, infos, request_id, created, model, req.n, echo, include_usage,
                                  req.logprobs is not None)
            return EventStreamResponse(events, on_close=stream.abort)
        finals = await self.collect(stream, raw_request)
        return JSONResponse(self._response(finals, infos, request_id, created, model, req.n, echo,
                                           req.logprobs is not None))

    def _response(self, finals: dict[int, RequestOutput], infos: list[PromptInfo], request_id: str, created: int,
                  model: str, n: int, echo: bool, want_logprobs: bool) -> dict:
        choices, completion_tokens = [], 0
        for pi, info in enumerate(infos):
            for c in finals[pi].outputs:
                prefix = (info.text or "") if echo else ""
                logprobs = completion_logprobs(c, 0, len(c.token_ids), 0)[0] if want_logprobs else None
                choices.append({"index": pi * n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                "token_ids": c.token_ids})
                completion_tokens += len(c.token_ids)
        choices.sort(key=lambda ch: ch["index"])
        prompt_tokens = sum(len(info.token_ids) for info in infos)
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens), "system_fingerprint": None}

    async def _stream(self, stream: RequestStream, infos: list[PromptInfo], request_id: str, created: int,
                      model: str, n: int, echo: bool, include_usage: bool, want_logprobs: bool):
        progress = ChoiceProgress(len(infos) * n)
        offsets = [0] * (len(infos) * n)
        base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        try:
            async for pi, out in stream:
                for c in out.outputs:
                    i = pi * n + c.index
                    new = progress.advance(i, c)
                    if new is None:
                        continue
                    start, end, text = new
                    if echo and start == 0:
                        text = (infos[pi].text or "") + text
                    logprobs: Optional[dict] = None
                    if want_logprobs:
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
