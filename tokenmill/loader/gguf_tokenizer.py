"""Build an HF tokenizer from a GGUF file's metadata (byte-level BPE vocabularies).

GGUF files carry no tokenizer.json; the vocabulary, merges, token types and the pre-tokenizer's name
are metadata under llama.cpp's keys. We rebuild the tokenizer with the `tokenizers` library
directly, which takes a fraction of a second. Sentencepiece-style vocabularies (`llama`) are left
to transformers' own GGUF conversion (slower, but only on the first load: the result is cached).
"""

from typing import Any, Optional

from tokenmill.errors import ModelLoadError

# Text splitting before BPE, by `tokenizer.ggml.pre` (the regexes llama.cpp uses for these names).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
                 "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# These split every digit apart, then apply the GPT-2 rules.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}

_CONTROL, _USER_DEFINED = 3, 4


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _pre_tokenizer(pre: Optional[str]):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"), byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def build_gguf_tokenizer(metadata: dict[str, Any]):
    """A PreTrainedTokenizerFast for a GGUF whose tokenizer model is "gpt2" (byte-level BPE)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"no fast tokenizer builder for GGUF tokenizer model {kind!r}")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    alphabet = set(_byte_alphabet().values())
    spell = _byte_alphabet()
    # Some files store a few tokens as raw text; respell them in the byte alphabet like the rest.
    vocab = {
        (tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tk.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    tk.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None:
        control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                   if ty == _CONTROL and set(t) <= alphabet]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        tk.add_special_tokens(control)
        tk.add_tokens(user)

    def token(key: str) -> Optional[str]:
        idx = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos = token("bos_token_id")
    if bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None:
        bos_id = int(metadata["tokenizer.ggml.bos_token_id"])
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=bos,
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
