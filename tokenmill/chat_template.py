"""Chat templates: a conversation rendered to prompt text with the tokenizer's template (or a given
Jinja one). Shared by the offline LLM class and the HTTP server, below both."""

from typing import Any, Optional

from tokenmill.errors import InvalidRequestError

# apply_chat_template's own parameters, which chat_template_kwargs may not override.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def render_chat(tok, conversation: list[dict], add_generation_prompt: bool = True, chat_template: Optional[str] = None,
                chat_template_kwargs: Optional[dict[str, Any]] = None, tools: Optional[list[dict[str, Any]]] = None) -> str:
    """The conversation as prompt text: the tokenizer's chat template, or `chat_template` (a Jinja
    string), given `tools` and `chat_template_kwargs`; InvalidRequestError if it cannot render."""
    if tok is None or not (chat_template or getattr(tok, "chat_template", None)):
        raise InvalidRequestError("this model has no chat template")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)} (a parameter of "
                                  "the rendering itself)")
    if chat_template is not None and not isinstance(chat_template, str):
        raise InvalidRequestError("chat_template must be a string (a Jinja template)")
    try:
        text = tok.apply_chat_template(conversation, tools=tools, chat_template=chat_template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:  # jinja raises many kinds
        raise InvalidRequestError(f"cannot apply the chat template: {type(e).__name__}: {e}") from None
    if not isinstance(text, str):
        raise InvalidRequestError("the chat template did not render to text")
    return text
