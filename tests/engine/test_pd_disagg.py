"""Prefill/decode disaggregation in process (kv_connector/shared_storage.py): a producer engine writes
its prompts' KV blocks into a shared directory, a consumer engine loads them and computes only the
rest. On the embedded model: the consumer's greedy outputs (with n-gram speculation, and one request
under a JSON-schema grammar) equal a plain engine's, the producer's prompts prefilled in chunks; a
corrupt block file fails the load and the prefix is recomputed to the same output; an abort while
the load is in flight leaks no block; an adapter's blocks pass under its own keys (its output equal,
the base model's request on the same prompt finding none); the directory's files stay whole and
within the producer's bounds. The same through two `tokenmill serve` processes and the proxy: tests/server/test_pd_server.py."""

import dataclasses
import json
import os
import time

import pytest
import torch

from tests.engine.conftest import assert_no_leaks, make_llm
from tokenmill import StructuredOutputsParams
from tokenmill.config import KVTransferConfig
from tokenmill.engine.block_hash import hash_blocks
from tokenmill.kv_connector.block_store import BlockFileStore, BlockStoreError, StoreBounds
from tokenmill.sampling_params import SamplingParams

BS = 16
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
          "additionalProperties": False}
CONTEXT = ("The tide rose over the harbour wall while the fishing boats came home one by one, their lamps "
           "swinging in the dusk. ")
QUESTIONS = ["Name one animal that lives in the sea.", "Answer in JSON: which city is the capital of France?",
             "Repeat the first sentence below word for word."]
NEW_TOKENS = 16


def connector(path, role: str) -> KVTransferConfig:
    return KVTransferConfig("SharedStorageConnector", role, {"path": str(path)})


def requests(llm) -> tuple[list[list[int]], list[SamplingParams]]:
    """Chat prompts of several blocks each (the question first: each has blocks of its own); the
    second under a JSON schema."""
    prompts = [llm.engine.tokenize(llm.render_chat([{"role": "user", "content": q + " " + CONTEXT}]),
                                   add_special_tokens=False) for q in QUESTIONS]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    grammar = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return prompts, [greedy, grammar, greedy]


def prefill(llm, prompts, params, lora=None) -> None:
    """What the proxy asks of the prefill engine: the same requests with one output token."""
    llm.generate(prompts, [dataclasses.replace(p, max_tokens=1) for p in params], use_tqdm=False, lora_request=lora)


@pytest.fixture(scope="module")
def engines(smollm, tmp_path_factory):
    path = tmp_path_factory.mktemp("kv")
    plain = make_llm(smollm, num_kv_blocks=64)
    # The producer prefills in chunks of 32 tokens: its blocks are saved once a prompt's last chunk ran.
    producer = make_llm(smollm, num_kv_blocks=64, max_num_batched_tokens=32,
                        kv_transfer_config=connector(path, "kv_producer"))
    consumer = make_llm(smollm, num_kv_blocks=64, speculative_config=NGRAM,
                        kv_transfer_config=connector(path, "kv_consumer"))
    return path, plain, producer, consumer


def test_decode_engine_loads_the_prefill_and_matches_one_engine(engines):
    path, plain, producer, consumer = engines
    prompts, params = requests(plain)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    json.loads(plain.generate([prompts[1]], params[1], use_tqdm=False)[0].outputs[0].text)  # the grammar held
    loadable = sum((len(p) - 1) // BS * BS for p in prompts)

    prefill(producer, prompts, params)
    assert len(os.listdir(path)) == producer.engine.snapshot().kv_transfer.blocks_saved > 0  # shared blocks once
    out = consumer.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == reference
    assert [o.metrics.num_cached_prompt_tokens for o in out] == [(len(p) - 1) // BS * BS for p in prompts]
    moved = consumer.engine.snapshot().kv_transfer
    assert moved.loaded_tokens == loadable and moved.blocks_loaded == loadable // BS and moved.failed_loads == 0
    assert consumer.engine.spec_stats.snapshot().drafts > 0  # n-gram speculation ran on the loaded prompts
    assert not os.listdir(path)  # the consumer removed what it loaded

    # A corrupt block (cut short) fails its request's load: that prefix is recomputed, same tokens.
    consumer.engine.reset_prefix_cache()
    prefill(producer, prompts, params)  # (from the producer's own prefix cache this time)
    own = (len(prompts[0]) - 1) // BS  # the first prompt's last loadable block is its own (its question)
    damaged = path / (hash_blocks(None, prompts[0][:own * BS], BS)[-1].hex() + ".kv")
    with open(damaged, "r+b") as f:
        f.truncate(100)
    out = consumer.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == reference
    moved = consumer.engine.snapshot().kv_transfer
    assert moved.failed_loads == 1 and moved.loaded_tokens == 2 * loadable - own * BS
    assert not os.listdir(path)  # the damaged file was removed with the failed load
    assert_no_leaks(consumer)
    assert_no_leaks(producer)


def test_abort_while_loading_leaks_no_block(engines):
    _, plain, producer, consumer = engines
    prompts, params = requests(plain)
    consumer.engine.reset_prefix_cache()
    prefill(producer, prompts[:1], params[:1])
    engine = consumer.engine
    req_id = engine.add_request(None, params[0], prompt_ids=prompts[0])
    engine.step()
    assert list(engine.scheduler.loading) == [req_id]  # its blocks are being read from the store
    engine.abort_request(req_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(consumer)
    assert_no_leaks(producer)


def test_an_adapters_blocks_pass_under_its_own_keys(smollm, hf_smollm, tmp_path_factory):
    """Both engines serve the same adapter (same name, id and directory, as two servers started with
    the same --lora-modules): the consumer loads the producer's LoRA blocks and its greedy output is
    the one it computes alone; the base model's request on the same prompt loads nothing."""
    from tests.lora_adapters import make_adapter
    from tokenmill.lora.request import LoRARequest

    path = tmp_path_factory.mktemp("kv-lora")
    lora = LoRARequest("a", 1, make_adapter(hf_smollm, tmp_path_factory.mktemp("adapter") / "a", rank=8))
    kw = dict(num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    producer = make_llm(smollm, kv_transfer_config=connector(path, "kv_producer"), **kw)
    consumer = make_llm(smollm, kv_transfer_config=connector(path, "kv_consumer"), **kw)
    prompts, params = requests(producer)
    prompt, greedy = prompts[0], params[0]
    alone = consumer.generate([prompt], greedy, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
    base = consumer.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert alone != base  # the adapter matters, or matching it would show nothing
    consumer.engine.reset_prefix_cache()
    prefill(producer, [prompt], [greedy], lora)
    assert consumer.generate([prompt], greedy, use_tqdm=False)[0].metrics.num_cached_prompt_tokens == 0
    out = consumer.generate([prompt], greedy, use_tqdm=False, lora_request=lora)[0]
    assert out.outputs[0].token_ids == alone
    assert out.metrics.num_cached_prompt_tokens == (len(prompt) - 1) // BS * BS
    assert consumer.engine.snapshot().kv_transfer.loaded_tokens == (len(prompt) - 1) // BS * BS
    assert_no_leaks(consumer)
    assert_no_leaks(producer)


def test_bad_options_are_refused(tmp_path):
    from tokenmill.config import ConfigError, EngineConfig
    from tokenmill.kv_connector.factory import make_scheduler_connector

    for extra, message in (({"io_threads": 0}, "io_threads >= 1"), ({"threads": 2}, r"unknown .*\['threads'\]")):
        config = EngineConfig(kv_transfer_config=KVTransferConfig("SharedStorageConnector", "kv_both",
                                                                  {"path": str(tmp_path), **extra}))
        with pytest.raises(ConfigError, match=message):
            make_scheduler_connector(config, 1024)


def test_the_store_keeps_whole_blocks_within_its_bounds(tmp_path):
    """The producer's side of the directory alone: files over max_bytes go oldest first, files past
    the TTL go, a block of another layout or cut short is refused on reading."""
    store = BlockFileStore(str(tmp_path))
    blocks = [torch.full((1024,), i, dtype=torch.uint8) for i in range(3)]
    keys = [bytes([i]) * 32 for i in range(3)]
    for key, block in zip(keys, blocks):
        assert store.write(key, b"t" * 16, block)
    assert not store.write(keys[0], b"t" * 16, blocks[0])  # there already
    assert store.evict(StoreBounds(max_bytes=2048, ttl_s=60)) == 1 and not store.has(keys[0])
    out = torch.empty(1024, dtype=torch.uint8)
    store.read_into(keys[1], b"t" * 16, out)
    assert torch.equal(out, blocks[1])
    with pytest.raises(BlockStoreError, match="another block layout"):
        store.read_into(keys[1], b"u" * 16, out)
    os.truncate(store.file_of(keys[2]), 500)
    with pytest.raises(BlockStoreError, match="of 1024 bytes"):
        store.read_into(keys[2], b"t" * 16, out)
    assert store.evict(StoreBounds(max_bytes=2048, ttl_s=60), now=time.monotonic() + 61) == 2
    assert not os.listdir(tmp_path)
    # Writes from several threads at once (the connector's I/O threads) keep the books whole.
    from concurrent.futures import ThreadPoolExecutor

    many = [bytes([9, i]) * 16 for i in range(64)]
    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(lambda key: store.write(key, b"t" * 16, blocks[0]), many))
    assert list(store.written) != [] and store.written_bytes == 64 * 1024 == sum(n for _, n in store.written.values())
