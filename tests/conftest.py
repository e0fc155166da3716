import os
import random

import numpy as np
import pytest
import torch

from nanovllm.utils.tiny_model import write_tiny_qwen3  # imports no Triton kernel

# Without a GPU, Triton kernels run under Triton's interpreter on CPU tensors. This must be set
# before any kernel is defined, i.e. before the test modules import nanovllm.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _round_like_the_gpu():
    """Triton's interpreter (3.6 to 3.9 at least) rounds float32 to fp8 e4m3 by incrementing the 3-bit
    mantissa without carrying into the exponent (126.9 becomes 64, not 128), and float32 to bfloat16 by
    truncating. Convert through torch, which rounds to nearest even like the GPU's cvt.rn, so the fp8 KV
    store and bf16 kernels can be tested on CPU. It also reads e4m3fn's NaN (0x7F, 0xFF) as +-480, so a
    kernel that lets a NaN slot of an fp8 cache into its result would pass on CPU: fp8 is widened
    through torch too."""
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    torch_dtypes = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.bfloat16: (torch.bfloat16, torch.int16)}

    wider = {tl.float16: (torch.float16, torch.int16), tl.float32: (torch.float32, torch.int32)}

    def fixed(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in torch_dtypes:
            dtype, bits = torch_dtypes[output_dtype]
            return torch.tensor(input, dtype=torch.float32).to(dtype).view(bits).numpy()
        if input_dtype == tl.float8e4nv and output_dtype in wider:
            dtype, bits = wider[output_dtype]
            fp8 = torch.from_numpy(np.frombuffer(input.tobytes(), dtype=np.uint8).copy()).view(torch.float8_e4m3fn)
            return fp8.to(dtype).view(bits).numpy().reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = fixed


if os.environ.get("TRITON_INTERPRET") == "1":
    _round_like_the_gpu()
# The tiny model's ops are far too small to gain from intra-op threads; one thread also keeps
# timings steady when tensor-parallel worker processes share the cores.
torch.set_num_threads(1)


NUM_NEW_TOKENS = 24


def pytest_collection_modifyitems(config, items):
    """Where CUDA is visible, the engine picks the GPU and Triton's interpreter is off, so the CPU suite
    (token-exact float32 comparisons with transformers on the CPU, Triton kernels on CPU tensors,
    tensor parallel over gloo) cannot run in the same process: it is skipped, saying how to run it."""
    if not torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CPU suite: on a CUDA machine run it with `CUDA_VISIBLE_DEVICES= python -m pytest`")
    for item in items:
        if "cpu_suite" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seeded_global_rngs():
    """Each test starts from torch's (CPU and CUDA), numpy's and random's global generators seeded alike,
    so that a failure on a rare draw reproduces, alone or in the suite, on the CPU or the GPU."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Tiny random Qwen3 (tied embeddings) written by transformers, float32."""
    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    write_tiny_qwen3(path)
    return path


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
    return unique + [shared + [1, 2, 3], shared + [4, 5], shared[:32], unique[3], shared + [1, 2, 3]]


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
