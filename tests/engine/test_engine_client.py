"""The three engine front-ends implement the one declared interface (engine/client.EngineClient)."""

import inspect

import pytest

from tokenmill.engine.client import ENGINE_CLIENT_METHODS, EngineClient
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.serve.core_client import EngineCoreClient
from tokenmill.serve.dp_client import DPEngineClient


@pytest.mark.parametrize("cls", [LLMEngine, EngineCoreClient, DPEngineClient])
def test_front_ends_have_every_method_of_the_interface(cls):
    assert {"add_request", "abort_request", "step", "snapshot", "add_lora", "list_loras", "check_health"} \
        <= set(ENGINE_CLIENT_METHODS)
    for name in ENGINE_CLIENT_METHODS:
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} lacks {name}"
        wanted = [p for p in inspect.signature(getattr(EngineClient, name)).parameters if p != "self"]
        have = inspect.signature(method).parameters
        missing = [p for p in wanted if p not in have]
        assert not missing, f"{cls.__name__}.{name} lacks parameters {missing}"
