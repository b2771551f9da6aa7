"""POST /v1/chat/completions.

The messages are rendered with the chat template (the request's `chat_template`, else the server's
--chat-template, else the model's; `chat_template_kwargs` become template variables) and tokenized on
a prepare worker of the AsyncLLMEngine (never on the engine thread, whose steps a long conversation
would otherwise stall). Streaming follows OpenAI: a first chunk per choice with the assistant role,
then one chunk per generated token (content may be empty while text is held back), the finish reason
on the last one, an optional usage chunk (stream_options.include_usage), and `data: [DONE]`.

Tools (serve/openai/tools.py, tool_parsers.py): `tools` reach the template (or its system
message, for templates that ignore them); tool_choice "required" and a named function constrain the
output with structured output, "auto" reads it with the server's --tool-call-parser. Calls come back
as OpenAI's `message.tool_calls` (streamed: `delta.tool_calls`, a call's start with id and name, then
its arguments in fragments as they are generated) with finish_reason "tool_calls" (unless the output
was cut at max_tokens: "length"). With tools, a token that shows nothing yet (a tag or call being
read) sends no chunk: the next chunk carries its token ids and logprobs.
"""

import json
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.serve.async_engine import PromptInfo, PromptTools, RequestAborted, RequestStream, check_encodable
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.chat_template import render_chat
from tokenmill.engine.request_validator import longest_token_chars
from tokenmill.serve.openai.errors import APIError, echoed, stream_error_event
from tokenmill.serve.openai.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.serve.openai.serving_common import (SSE_DONE, ChoiceProgress, EventStreamResponse, OpenAIServing,
                                                         clamp_logprob, now_s, sse, token_str, usage)
from tokenmill.serve.openai.tool_parsers import ToolCallStreamer, ToolParser, get_tool_parser, new_call_id
from tokenmill.serve.openai.tools import (FunctionTool, ToolChoice, ToolRequestError, compile_forced,
                                                forced_call_output, output_parser, parse_tools, resolve_tool_choice,
                                                template_conversation)
from tokenmill.structured_outputs import StructuredOutputsParams


def message_dict(i: int, m: ChatMessage) -> dict:
    content = m.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise APIError(400, f"messages[{i}]: only text content parts are supported (got type "
                                    f"{echoed(part.type)!r})", param=f"messages.{i}.content")
            if part.text is None:
                raise APIError(400, f"messages[{i}].content[{j}]: a text content part needs a `text` string",
                               param=f"messages.{i}.content.{j}.text")
            parts.append(part.text)
        text = "\n".join(parts)
    check_encodable(text, f"messages[{i}].content")
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
    if m.name:
        check_encodable(m.name, f"messages[{i}].name")
        out["name"] = m.name
    if m.tool_calls:
        if m.role != "assistant":
            raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls (this one is {m.role!r})",
                           param=f"messages.{i}.tool_calls")
        out["tool_calls"] = [_message_call(i, j, c) for j, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        if not m.tool_call_id:
            raise APIError(400, f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                           param=f"messages.{i}.tool_call_id")
        check_encodable(m.tool_call_id, f"messages[{i}].tool_call_id")
        out["tool_call_id"] = m.tool_call_id
    return out


def _message_call(i: int, j: int, call) -> dict:
    arguments = call.function.arguments
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    check_encodable(call.function.name, f"messages[{i}].tool_calls[{j}].function.name")
    check_encodable(arguments, f"messages[{i}].tool_calls[{j}].function.arguments")
    return {"id": call.id or new_call_id(), "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


@dataclass
class ChatPrompt:
    """A chat request's rendering inputs, checked on the event loop; `render` runs on a worker."""

    messages: list[dict]
    tools: list[FunctionTool]
    chat_template: Optional[str]
    chat_template_kwargs: Optional[dict]
    add_generation_prompt: bool

    def render(self, tokenizer, fallback: Optional[ToolParser]) -> str:
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        conversation, tools = template_conversation(self.messages, self.tools, template, fallback)
        return render_chat(tokenizer, conversation, self.add_generation_prompt, chat_template=self.chat_template,
                           chat_template_kwargs=self.chat_template_kwargs, tools=tools)


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


@dataclass
class ToolPlan:
    """What a request's tools mean for it: the tools, the resolved tool_choice, the structured output
    that forces a call (required, named), and the parser that reads calls out of the output (None:
    no calls can be made)."""

    tools: list[FunctionTool]
    choice: ToolChoice
    forced: Optional[StructuredOutputsParams]
    parser: Optional[ToolParser]


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, chat_template: Optional[str] = None, tool_call_parser: Optional[str] = None,
                 enable_auto_tool_choice: bool = False, trust_request_chat_template: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        # A request's own chat_template runs a client's Jinja on the server: only when trusted.
        self.trust_request_chat_template = trust_request_chat_template
        self._tokenizer = self.engine.engine.tokenizer
        self._max_prompt_chars: Optional[int] = None  # check_conversation_chars's bound
        self.chat_template = chat_template  # the server's --chat-template, else None (the model's)
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.auto_tool_choice = enable_auto_tool_choice and self.tool_parser is not None

    def chat_prompt(self, messages: list[ChatMessage], tools: list[FunctionTool], req) -> ChatPrompt:
        """The rendering inputs of a chat or /tokenize request (APIError for bad messages)."""
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(400, "chat_template in a request needs a server started with "
                                "--trust-request-chat-template (it runs the client's Jinja template)",
                           param="chat_template")
        conversation = [message_dict(i, m) for i, m in enumerate(messages)]
        self.check_conversation_chars(conversation)
        return ChatPrompt(conversation, tools,
                          req.chat_template if req.chat_template is not None else self.chat_template,
                          req.chat_template_kwargs, req.add_generation_prompt)

    @property
    def max_prompt_chars(self) -> int:
        """The most characters of text that could fit the context (engine/request_validator.py)."""
        if self._max_prompt_chars is None:  # a race only computes it twice
            self._max_prompt_chars = self.engine.max_model_len * longest_token_chars(self._tokenizer)
        return self._max_prompt_chars

    def check_conversation_chars(self, conversation: list[dict]) -> None:
        """Refuse messages whose text alone could not fit the context, before the template renders them
        (RequestValidator checks the rendered prompt the same way before tokenizing it)."""
        if self._tokenizer is None:
            return
        chars = 0
        for m in conversation:
            chars += len(m["content"]) + len(m.get("name", ""))
            for call in m.get("tool_calls", ()):
                chars += len(call["function"]["name"]) + len(call["function"]["arguments"])
        if chars > self.max_prompt_chars:
            raise APIError(400, f"the messages have {chars} characters, more than the {self.max_prompt_chars} "
                                f"that could fit the context length of {self.engine.max_model_len} tokens",
                           param="messages")

    def render(self, prompt: ChatPrompt) -> str:
        """The prompt text (call it on a worker thread: templates can be slow)."""
        return prompt.render(self._tokenizer, self.tool_parser)

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan:
        try:
            tools = parse_tools(req.tools)
            choice = resolve_tool_choice(req.tool_choice, tools,
                                         self.tool_parser.name if self.auto_tool_choice else None)
        except ToolRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        max_calls = 1 if req.parallel_tool_calls is False else req.max_tool_calls
        return ToolPlan(tools, choice, forced_call_output(choice, tools, max_calls),
                        output_parser(choice, self.tool_parser, max_calls))

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        model, lora_request = self.resolve_model(req.model)
        plan = self.tool_plan(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        prompt = self.chat_prompt(req.messages, plan.tools, req)
        top_k = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.check_sequences(1, req.n, "n")
        params = self.request_params(req, raw_request, max_tokens, top_k)
        if plan.forced is not None:
            if params.structured_outputs is not None:
                raise APIError(400, f"tool_choice {plan.choice.mode!r} constrains the output itself; it cannot be "
                                    "combined with response_format or structured output fields", param="tool_choice")
            params.structured_outputs = plan.forced
        parser = plan.parser

        def prepare(prompt_tools: PromptTools) -> list[tuple[Optional[str], list[int]]]:  # on a prepare worker
            if plan.forced is not None:
                compile_forced(self.engine.engine.structured.compile, plan.choice, plan.tools, plan.forced)
            text = self.render(prompt)
            return [(text, prompt_tools.tokenize(text, add_special_tokens=False))]

        request_id = self.new_id("chatcmpl")
        try:
            stream, infos = await self.submit(prepare, params, request_id, lora_request)
        except ToolRequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        created = now_s()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = self._stream(stream, infos, request_id, created, model, req.n, include_usage, top_k, parser)
            return EventStreamResponse(events, on_close=stream.abort)
        finals = await self.collect(stream, raw_request)
        return JSONResponse(self._response(finals[0], infos[0], request_id, created, model, top_k, parser))

    @staticmethod
    def _response(final: RequestOutput, info: PromptInfo, request_id: str, created: int, model: str, top_k,
                  parser: Optional[ToolParser]) -> dict:
        choices = []
        for c in final.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if parser is not None:
                found = parser.extract(c.text)
                if found.calls:
                    message = {"role": "assistant", "content": found.content or None,
                               "tool_calls": [call.to_openai() for call in found.calls]}
                    finish_reason = _with_calls(finish_reason)
            choices.append({
                "index": c.index, "message": message,
                "logprobs": chat_logprobs(c, 0, len(c.token_ids), top_k) if top_k is not None else None,
                "finish_reason": finish_reason, "stop_reason": c.stop_reason, "token_ids": c.token_ids,
            })
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage(len(info.token_ids), completion_tokens),
                "system_fingerprint": None}

    @staticmethod
    async def _stream(stream: RequestStream, infos: list[PromptInfo], request_id: str, created: int, model: str,
                      n: int, include_usage: bool, top_k, parser: Optional[ToolParser]):
        progress = ChoiceProgress(n)
        streamers: Optional[list[ToolCallStreamer]] = [parser.streamer() for _ in range(n)] if parser else None
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": None}
        extra = {"usage": None} if include_usage else {}
        held: list[Optional[int]] = [None] * n  # first token of a choice's chunks held back (tool streams)
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
                    finish_reason = c.finish_reason
                    if streamers is None:
                        delta = {"content": text} if (text or not progress.done[i]) else {}
                    else:
                        delta, made_calls = _tool_delta(streamers[i], text, progress.done[i])
                        if made_calls:
                            finish_reason = _with_calls(finish_reason)
                        if not delta and finish_reason is None:  # nothing to show yet: no empty chunk
                            held[i] = start if held[i] is None else held[i]
                            continue
                        if held[i] is not None:  # the chunk carries the held tokens' ids and logprobs too
                            start, held[i] = held[i], None
                    choice = {"index": i, "delta": delta,
                              "logprobs": chat_logprobs(c, start, end, top_k) if top_k is not None else None,
                              "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                              "token_ids": c.token_ids[start:end]}
                    yield sse(dict(base, choices=[choice], **extra))
            if include_usage:
                yield sse(dict(base, choices=[], usage=usage(len(infos[0].token_ids), progress.completion_tokens)))
        except RequestAborted:
            return
        except Exception as e:  # the engine died or shut down mid-stream: tell the client in-band
            yield stream_error_event(e)
        yield SSE_DONE


def _with_calls(finish_reason: Optional[str]) -> Optional[str]:
    """The finish reason of a choice that made calls: "tool_calls", unless it was cut short."""
    return finish_reason if finish_reason in (None, "length") else "tool_calls"


def _tool_delta(streamer: ToolCallStreamer, text: str, done: bool) -> tuple[dict, bool]:
    """A streamed choice's delta through its tool-call streamer; and whether it made calls."""
    d = streamer.feed(text)
    if done:
        d.extend(streamer.finish())
    delta: dict[str, Any] = {}
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        delta["tool_calls"] = [t.to_openai() for t in d.tool_calls]
    return delta, streamer.num_calls > 0
