"""Request bodies of the OpenAI-compatible API, as pydantic models (they also make the OpenAPI schema).

Field names, defaults and meanings follow OpenAI's public API reference. Fields OpenAI does not
have (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens,
include_stop_str_in_output, add_generation_prompt, chat_template, chat_template_kwargs) are
extensions with the same names vLLM uses, as are `cache_salt` and the /tokenize and /detokenize
bodies. Unknown top-level fields are ignored, so newer clients keep working, and logged once per name
(RequestBody keeps them in `model_extra` for that). Token ids are strict integers (no `true`, no
"0"). Bounds that protect the engine (integers that must fit its int64 tables, the number of
choices) are enforced here; the rest is checked by SamplingParams and the engine, which know the model.
"""

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from tokenmill.sampling_params import MAX_LOGPROBS

MAX_N = 128  # choices per prompt
INT32_MAX = 2**31 - 1
INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestBody(OpenAIModel):
    """A route's whole body: unknown fields are kept aside (model_extra) so the server can name them."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: Optional[bool] = False


class _SamplingFields(OpenAIModel):
    """What completions and chat completions share."""

    model: Optional[str] = Field(None, description="a served model name; default: the first one")
    temperature: Optional[float] = Field(None, ge=0, description="0 is greedy; default 1")
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N, description="choices to generate for each prompt")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = Field(None, description="up to 32 stop strings")
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    presence_penalty: Optional[float] = Field(0.0, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    user: Optional[str] = None
    # Extensions (vLLM's names).
    top_k: Optional[int] = Field(None, ge=-1, le=INT32_MAX, description="0 or -1: off")
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[StrictInt]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    bad_words: Optional[list[str]] = Field(None, description="words never generated (each as its tokens)")
    allowed_token_ids: Optional[list[StrictInt]] = Field(None, description="sample only among these token ids")
    cache_salt: Optional[str] = Field(None, min_length=1, description="requests share prefix-cache blocks only with "
                                                                      "requests of the same salt")
    # Structured output (vLLM's names; serve/openai/response_format.py reads them).
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


class CompletionRequest(_SamplingFields, RequestBody):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]] = Field(
        ..., description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    max_tokens: Optional[int] = Field(16, description="tokens to generate per choice; null: up to the context")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ContentPart(OpenAIModel):
    type: str
    text: Optional[str] = None


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: Union[str, dict[str, Any]] = Field("{}", description="JSON text (OpenAI's form) or an object")


class MessageToolCall(OpenAIModel):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = Field(None, description="an assistant message's calls")
    tool_call_id: Optional[str] = Field(None, description="a tool message: the call it answers")


class _ChatTemplateFields(OpenAIModel):
    """What rendering a conversation takes (vLLM's names)."""

    tools: Optional[list[dict[str, Any]]] = Field(
        None, description="[{'type': 'function', 'function': {'name', 'description', 'parameters'}}]")
    chat_template: Optional[str] = Field(None, description="a Jinja chat template instead of the model's")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="extra variables for the template")
    add_generation_prompt: bool = Field(True, description="end with the assistant header")


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields, RequestBody):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: Optional[dict[str, Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = Field(
        None, description="none, auto (the default with tools), required, or "
                          "{'type': 'function', 'function': {'name'}}")
    parallel_tool_calls: Optional[bool] = Field(True, description="false: at most one call")
    max_tool_calls: Optional[int] = Field(None, ge=1, le=128, description="at most this many calls in the answer")


class TokenizeRequest(_ChatTemplateFields, RequestBody):
    """POST /tokenize (vLLM's shape): a `prompt`, or chat `messages` rendered with the chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = Field(None, description="default: true for a prompt, false for messages")
    return_token_strs: bool = Field(False, description="also return each token's string")


class DetokenizeRequest(RequestBody):
    model: Optional[str] = None
    tokens: list[StrictInt]


class LoadLoRAAdapterRequest(RequestBody):
    """POST /v1/load_lora_adapter (vLLM's shape)."""

    lora_name: str = Field(..., description="the name requests give as `model`")
    lora_path: str = Field(..., description="the adapter's directory as PEFT saves it, on the server's machine")


class UnloadLoRAAdapterRequest(RequestBody):
    """POST /v1/unload_lora_adapter (vLLM's shape): the adapter's name, or its id."""

    lora_name: Optional[str] = None
    lora_int_id: Optional[int] = Field(None, ge=1, le=INT32_MAX)


class ErrorInfo(BaseModel):
    message: str = Field(..., description="what is wrong, in words")
    type: str = Field(..., description="e.g. invalid_request_error, server_overloaded, service_unavailable_error")
    param: Optional[str] = Field(None, description="the request field at fault, if one is")
    code: Optional[str] = Field(None, description="a stable machine-readable code, e.g. model_not_found")


class ErrorResponse(BaseModel):
    """OpenAI's error body: what every 4xx and 5xx answer carries."""

    error: ErrorInfo
