"""The embedded default model: tokenmill's GGUF load computes what HF transformers computes."""

import torch

from tests.helpers import full_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived",
    "Water boils at a temperature of 100 degrees",
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_logits_match_hf(smollm, hf_smollm):
    seqs = [smollm.tokenizer(p)["input_ids"] for p in PROMPTS]
    ours = full_logits(smollm.model, seqs)
    for seq, logits in zip(seqs, ours):
        with torch.no_grad():
            ref = hf_smollm(torch.tensor([seq])).logits[0].float()
        assert logits.shape == ref.shape
        assert rel_err(logits, ref) < 1e-4


def test_greedy_continuation_matches_hf(smollm, hf_smollm):
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one paragraph."}]
    prompt = smollm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = smollm.tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        ref = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
    expected = ref[0, len(ids):].tolist()
    seq = list(ids)
    for _ in range(32):
        logits = full_logits(smollm.model, [seq])[0][-1]
        logits[smollm.eos_token_ids] = float("-inf")  # what min_new_tokens does in HF
        seq.append(int(logits.argmax()))
    assert seq[len(ids):] == expected
    assert "Paris" in smollm.tokenizer.decode(expected)


def test_tokenizer_matches_hf_gguf_tokenizer(smollm):
    from transformers import AutoTokenizer
    import os

    from tokenmill.loader.resolve import embedded_model_path

    path = embedded_model_path()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    texts = ["Hello world! It's 2024; 3.14159 is pi.  Spaces   here\n\nand newlines",
             "<|im_start|>user\nHi<|im_end|>", "naïve café 東京 🎉", "  leading spaces", "x=12345+678"]
    for text in texts:
        ours = smollm.tokenizer(text)["input_ids"]
        assert ours == ref(text)["input_ids"]
        assert smollm.tokenizer.decode(ours) == text
    chat = [{"role": "user", "content": "hi"}]
    assert smollm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_second_load_reads_the_cache(smollm):
    from tokenmill.loader import load_model
    from tokenmill.loader.gguf_loader import cache_root
    import os

    again = load_model(None, dtype="float32", device="cpu")
    converted = os.listdir(os.path.join(cache_root(), "gguf"))
    from tokenmill.loader.gguf_loader import CACHE_FORMAT

    assert any(name.endswith(f"-{CACHE_FORMAT}") for name in converted)
    for (name, a), (_, b) in zip(smollm.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(a, b), name


def test_converted_directory_loads_in_transformers(smollm, hf_smollm):
    """The HF directory a GGUF file is converted into is a valid HF model directory: transformers
    loads config, weights and tokenizer from it and computes what it computes from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.loader.gguf_loader import convert_gguf_to_hf_dir
    from tokenmill.loader.resolve import embedded_model_path

    directory = convert_gguf_to_hf_dir(embedded_model_path())
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert model.config.model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    assert ids == smollm.tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0]
        ref = hf_smollm(torch.tensor([ids])).logits[0]
    assert rel_err(ours, ref) < 1e-5
