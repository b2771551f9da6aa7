"""bad_words and allowed_token_ids through `tokenmill serve` and the official `openai` client
(vLLM's extra fields, sent in extra_body); bad values are 400s."""

import httpx
import pytest

from tests.server.conftest import SMALL_ENGINE

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(SMALL_ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    r.raise_for_status()
    return r.json()["tokens"]


def complete(client, **extra) -> str:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, **extra})
    return out.choices[0].text


def test_bad_words_and_allowed_token_ids(server, client):
    plain = complete(client)
    word = plain.split()[0].strip(".,!?")
    assert word
    banned = complete(client, bad_words=[word])
    # The tokens before the word's last one are the plain run's; the word itself never comes out.
    assert banned != plain and banned.startswith(plain[: plain.index(word)])
    assert word not in banned.split()
    phrase = " ".join(plain.split()[:2])  # several tokens: banned through the device-side history
    assert len(tokenize(server, " " + phrase)) > 1
    assert phrase not in complete(client, bad_words=[phrase])
    allowed = tokenize(server, " yes") + tokenize(server, " no")
    assert len(allowed) == 2
    only = complete(client, allowed_token_ids=allowed)
    assert only and only.replace(" yes", "").replace(" no", "") == ""


@pytest.mark.parametrize("extra, match", [
    ({"allowed_token_ids": []}, "must not be empty"),
    ({"allowed_token_ids": [10**8]}, "outside the vocabulary"),
    ({"bad_words": [""]}, "non-empty"),
])
def test_bad_values_are_400s(client, extra, match):
    with pytest.raises(openai.BadRequestError, match=match):
        complete(client, **extra)
