"""Hugging Face Hub ids (org/name) resolve through huggingface_hub's cache, offline here: a cache
built in the test in the hub's layout holds a tiny random Llama saved by HF transformers."""

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints import cli

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """<cache>/models--tiny-org--tiny-llama/{refs/main, snapshots/<revision>/...}."""
    import transformers as tf

    from tokenmill.loader.gguf_loader import convert_gguf_to_hf_dir
    from tokenmill.loader.resolve import embedded_model_path

    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / REVISION
    tokenizer = tf.AutoTokenizer.from_pretrained(convert_gguf_to_hf_dir(embedded_model_path()))
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            tie_word_embeddings=True)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return cache


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


SMALL = ["--num-kv-blocks", "16", "--max-model-len", "64", "--max-tokens", "3", "--raw"]


def test_a_hub_id_loads_from_the_cache_offline(hub_cache, offline, capsys):
    with LLM("tiny-org/tiny-llama", revision=REVISION, download_dir=str(hub_cache), num_kv_blocks=16,
             max_model_len=64) as llm:
        assert llm.llm_engine.model_name == "tiny-org/tiny-llama"  # the id, not the snapshot's hash
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    assert cli.main(["generate", "Hello", "--model", "tiny-org/tiny-llama", "--download-dir", str(hub_cache),
                     *SMALL]) == 0
    assert capsys.readouterr().out.strip()  # some text (random weights)


def test_a_hub_id_not_in_the_cache_offline_is_a_clear_error(hub_cache, offline, capsys):
    assert cli.main(["generate", "Hello", "--model", "tiny-org/absent", "--download-dir", str(hub_cache),
                     *SMALL]) == 2
    err = capsys.readouterr().err
    assert "'tiny-org/absent' is not in" in err and "HF_HUB_OFFLINE is set" in err, err
    assert cli.main(["generate", "Hello", "--model", "tiny-org/tiny-llama", "--revision", "v9",
                     "--download-dir", str(hub_cache), *SMALL]) == 2
    assert "at revision 'v9' is not in" in capsys.readouterr().err
