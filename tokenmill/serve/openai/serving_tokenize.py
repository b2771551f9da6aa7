"""POST /tokenize and POST /detokenize (vLLM's shapes).

/tokenize takes a `prompt` (add_special_tokens default true) or chat `messages` (rendered as chat
completions renders them: chat_template, chat_template_kwargs, tools, add_generation_prompt;
add_special_tokens default false, the template holds them) and answers `{"count", "max_model_len",
"tokens", "token_strs"}` (token_strs null unless `return_token_strs`). /detokenize takes
`{"tokens": [ids]}` and answers `{"prompt": text}`; an id outside the model's vocabulary, or not a
JSON integer (`true`, "0"), is a 400. A text too long to fit the context whatever its tokens is
refused before it is tokenized, as a completion's prompt is.
Both work on a worker thread, off the event loop, as the chat route's rendering does.
"""

import asyncio

from tokenmill.engine.request_validator import check_prompt_chars
from tokenmill.serve.async_engine import check_encodable
from tokenmill.serve.openai.errors import APIError
from tokenmill.serve.openai.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.serve.openai.serving_chat import OpenAIServingChat
from tokenmill.serve.openai.tools import ToolRequestError, parse_tools
from tokenmill.errors import InvalidRequestError
from tokenmill.logger import init_logger

logger = init_logger(__name__)


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat
        self.engine = chat.engine
        self.tokenizer = chat.engine.engine.tokenizer  # read-only, as on the prepare workers
        self.vocab_size = chat.engine.engine.vocab_size

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")

    async def tokenize(self, req: TokenizeRequest) -> dict:
        self.chat.model_name(req.model)
        self._need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            check_encodable(req.prompt, "prompt")
            check_prompt_chars(req.prompt, self.chat.max_prompt_chars, self.engine.max_model_len)
            text, special = req.prompt, req.add_special_tokens is not False
            prompt = None
        else:
            if not req.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            try:
                tools = parse_tools(req.tools)
            except ToolRequestError as e:
                raise APIError(400, str(e), param=e.param) from None
            prompt, text, special = self.chat.chat_prompt(req.messages, tools, req), None, bool(req.add_special_tokens)

        def work() -> tuple[list[int], list[str]]:
            rendered = self.chat.render(prompt) if prompt is not None else text
            check_encodable(rendered, "the rendered prompt")  # tools and template variables are free text
            check_prompt_chars(rendered, self.chat.max_prompt_chars, self.engine.max_model_len, "the rendered prompt")
            ids = list(self.tokenizer(rendered, add_special_tokens=special)["input_ids"])
            strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return ids, strs

        try:
            ids, strs = await asyncio.to_thread(work)
        except InvalidRequestError:
            raise
        except Exception as e:  # a tokenizer or template failing on odd input in a way of its own
            logger.warning("a /tokenize request could not be processed: %r", e)
            raise InvalidRequestError(f"the request could not be processed: {type(e).__name__}: {e}") from None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.chat.model_name(req.model)
        self._need_tokenizer()
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (size {self.vocab_size})", param="tokens")
        try:
            text = await asyncio.to_thread(self.tokenizer.decode, req.tokens)
        except Exception as e:  # an id the model has but its tokenizer does not
            raise APIError(400, f"the tokens cannot be decoded: {type(e).__name__}: {e}", param="tokens") from None
        return {"prompt": text}
