"""POST /v1/chat/completions.

The messages are rendered with the model's chat template and tokenized on a prepare worker of the
AsyncLLMEngine (never on the engine thread, whose steps a long conversation would otherwise stall).
Streaming follows OpenAI: a first chunk per choice with the assistant role, then one chunk per
generated token (content may be empty while text is held back), the finish reason on the last one,
an optional usage chunk (stream_options.include_usage), and `data: [DONE]`.
"""

from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.engine.async_engine import PromptInfo, PromptTools, RequestAborted, RequestStream, check_encodable
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.entrypoints.llm import LLM
from tokenmill.entrypoints.openai.errors import APIError, stream_error_event
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.entrypoints.openai.serving_common import (SSE_DONE, ChoiceProgress, EventStreamResponse, OpenAIServing,
                                                         clamp_logprob, now_s, sse, token_str, usage)


def message_dict(i: int, m: ChatMessage) -> dict:
    content = m.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"messages[{i}]: only text content parts are supported (got type "
                                    f"{part.type!r})", param=f"messages.{i}.content")
            parts.append(part.text)
        text = "\n".join(parts)
    check_encodable(text, f"messages[{i}].content")
    out = {"role": "system" if m.role == "developer" else m.role, "content": text}
    if m.name:
        check_encodable(m.name, f"messages[{i}].name")
        out["name"] = m.name
    return out


def chat_logprobs(c: CompletionOutput, start: int, end: int, top_k: int) -> dict:
    content = []
    for tid, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
        chosen = entry.get(tid)
        text = token_str(tid, chosen) if chosen is not None else f"token_id:{tid}"
        tops = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank <= top_k)[:top_k]
        content.append({
            "token": text, "logprob": clamp_logprob(chosen.logprob) if chosen is not None else None,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": token_str(t, lp), "logprob": clamp_logprob(lp.logprob),
                              "bytes": list(token_str(t, lp).encode("utf-8"))} for _, t, lp in tops],
        })
    return {"content": content}


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._templates = LLM.from_engine(self.engine.engine)  # its render_chat reads only the tokenizer

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        model = self.model_name(req.model)
        if req.tools and req.tool_choice != "none":
            raise APIError(400, "tool calling is not supported", param="tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        conversation = [message_dict(i, m) for i, m in enumerate(req.messages)]
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.check_sequences(1, req.n, "n")
        params = self.sampling_params(req, max_tokens, top_k)
        add_generation_prompt = req.add_generation_prompt

        def prepare(tools: PromptTools) -> list[tuple[Optional[str], list[int]]]:  # on a prepare worker
            text = self._templates.render_chat(conversation, add_generation_prompt)
            return [(text, tools.tokenize(text, add_special_tokens=False))]

        request_id = self.new_id("chatcmpl")
        stream, infos = await self.submit(prepare, params, request_id)
        created = now_s()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._stream(stream, infos, request_id, created, model, req.n, include_usage, top_k)
            return EventStreamResponse(events, on_close=stream.abort)
        finals = await self.collect(stream, raw_request)
        return JSONResponse(self._response(finals[0], infos[0], request_id, created, model, top_k))

    @staticmethod
    def _response(final: RequestOutput, info: PromptInfo, request_id: str, created: int, model: str, top_k) -> dict:
        choices = []
        for c in final.outputs:
            choices.append({
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, 0, len(c.token_ids), top_k) if top_k is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "token_ids": c.token_ids,
            })
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage(len(info.token_ids), completion_tokens),
                "system_fingerprint": None}

    @staticmethod
    async def _stream(stream: RequestStream, infos: list[PromptInfo], request_id: str, created: int, model: str,
                      n: int, include_usage: bool, top_k):
        progress = ChoiceProgress(n)
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": None}
        extra = {"usage": None} if include_usage else {}
        try:
            for i in range(n):
                yield sse(dict(base, choices=[{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}], **extra))
            async for _, out in stream:
                for c in out.outputs:
                    i = c.index
                    new = progress.advance(i, c)
                    if new is None:
                        continue
                    start, end, text = new
                    choice = {"index": i, "delta": {"content": text} if (text or not progress.done[i]) else {},
                              "logprobs": chat_logprobs(c, start, end, top_k) if top_k is not None else None,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                              "token_ids": c.token_ids[start:end]}
                    yield sse(dict(base, choices=[choice], **extra))
            if include_usage:
                yield sse(dict(base, choices=[], usage=usage(len(infos[0].token_ids), progress.completion_tokens)))
        except RequestAborted:
            return
        except Exception as e:  # the engine died or shut down mid-stream: tell the client in-band
            yield stream_error_event(e)
        yield SSE_DONE
