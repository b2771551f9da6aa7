"""Engine test fixtures: engines around the embedded model, HF greedy references, leak checks."""

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.llm import LLM

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "What does a CPU do?",
    "Give me a tip for learning to cook.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]
NEW_TOKENS = 32


def make_llm(loaded, **overrides) -> LLM:
    """An LLM over an already loaded model (engines share the weights; each owns its KV cache)."""
    defaults = dict(num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=2048)
    config = EngineConfig(**{**defaults, **overrides})
    return LLM.from_engine(LLMEngine(config=config, loaded=loaded))


def chat_ids(llm: LLM, question: str) -> list[int]:
    """The token ids of one user turn rendered with the chat template (generation prompt added)."""
    return llm.engine.tokenize(llm.render_chat([{"role": "user", "content": question}]), add_special_tokens=False)


def assert_no_leaks(llm: LLM) -> None:
    """Every KV block is back in the pool and no request or runner row is left."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)
    assert not engine.runner.states.row_of
    assert not engine.outputs.states


@pytest.fixture(scope="session")
def chat_prompt_ids(smollm):
    tok = smollm.tokenizer
    out = []
    for q in CHAT_PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


@pytest.fixture(scope="session")
def hf_greedy(hf_smollm, chat_prompt_ids):
    """HF transformers' greedy continuation of each prompt alone: exactly NEW_TOKENS tokens (EOS masked)."""
    refs = []
    for ids in chat_prompt_ids:
        with torch.no_grad():
            out = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, pad_token_id=2)
        refs.append(out[0, len(ids):].tolist())
    return refs


@pytest.fixture(scope="session")
def features_alone(smollm):
    """tests/engine/test_features_together.py's feature requests and each one's run alone on a plain
    engine (the reference of the busy runs there and in tests/engine/test_tensor_parallel.py):
    (requests, the plain greedy reference of the `animals` prompt, the banned token, outputs alone)."""
    from tests.engine.test_features_together import feature_requests

    plain = make_llm(smollm)
    requests, reference, banned = feature_requests(plain)
    alone = [plain.generate([p], q, use_tqdm=False)[0] for p, q in requests]
    assert_no_leaks(plain)
    return requests, reference, banned, alone
