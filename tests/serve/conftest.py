"""A server on 127.0.0.1 over the tiny checkpoint (its engine in a process of its own), for each
test module that asks for one, and an offline engine of the same options to compare with."""

import openai
import pytest

from nanovllm import LLM
from nanovllm.serve.server import ServerThread

MODEL_NAME = "tiny"
# Room for 64 concurrent requests of a few dozen tokens, in small blocks; a seed, so that the
# server's engine process draws the same noise run after run (requests without a seed repeat).
ENGINE_OPTIONS = dict(num_kvcache_blocks=256, kvcache_block_size=16, max_model_len=256, seed=0)
REQUEST_TIMEOUT = 120.0  # seconds: every client call is bounded


@pytest.fixture(scope="module")
def llm(tiny_model):
    """An offline engine of the same checkpoint and options as the server's: the oracle."""
    with LLM(tiny_model, **ENGINE_OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerThread(tiny_model, MODEL_NAME, engine_options=ENGINE_OPTIONS,
                      tokenizer_info=True) as server:
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=REQUEST_TIMEOUT) as client:
        yield client


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                              timeout=REQUEST_TIMEOUT)
