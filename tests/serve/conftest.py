"""A server on 127.0.0.1 over the tiny checkpoint, for each test module that asks for one."""

import openai
import pytest

from nanovllm import LLM
from nanovllm.serve.server import ServerThread

MODEL_NAME = "tiny"
# Room for 64 concurrent requests of a few dozen tokens, in small blocks.
ENGINE_OPTIONS = dict(num_kvcache_blocks=256, kvcache_block_size=16, max_model_len=256)
REQUEST_TIMEOUT = 120.0  # seconds: every client call is bounded


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, **ENGINE_OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(llm, MODEL_NAME) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=REQUEST_TIMEOUT) as client:
        yield client


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                              timeout=REQUEST_TIMEOUT)
