"""attention_backend="auto" resolves to the fastest backend measured for the device."""

import sys
import types

import pytest
import torch

from nanovllm.config import Config
from nanovllm.testing.tiny_model import write_tiny_qwen3

HOPPER, ADA, AMPERE = (9, 0), (8, 9), (8, 0)


@pytest.fixture(scope="module")
def head_dim_128(tmp_path_factory) -> str:
    """A checkpoint whose head size the flash-attn wheel takes."""
    path = str(tmp_path_factory.mktemp("tiny-head-dim-128"))
    write_tiny_qwen3(path, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=128, intermediate_size=512)
    return path


@pytest.fixture
def pretend_gpu(monkeypatch):
    """Make Config see one CUDA GPU of the given capability, with or without flash-attn."""

    def pretend(capability: tuple[int, int], flash_attn: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        module = types.ModuleType("flash_attn") if flash_attn else None  # None: ImportError
        monkeypatch.setitem(sys.modules, "flash_attn", module)

    return pretend


def backend(model: str, **options) -> str:
    return Config(model, **options).attention_backend


def test_hopper_picks_triton_even_with_flash_attn_installed(head_dim_128, pretend_gpu):
    pretend_gpu(HOPPER, flash_attn=True)
    assert backend(head_dim_128) == "triton"
    assert backend(head_dim_128, device="cuda") == "triton"


@pytest.mark.parametrize("capability", [AMPERE, ADA])
def test_other_gpus_pick_flash_attn_where_installed(head_dim_128, pretend_gpu, capability):
    pretend_gpu(capability, flash_attn=True)
    assert backend(head_dim_128) == "flash_attn"
    pretend_gpu(capability, flash_attn=False)
    assert backend(head_dim_128) == "triton"


def test_other_gpus_pick_triton_for_head_sizes_flash_attn_lacks(tiny_model, pretend_gpu):
    pretend_gpu(AMPERE, flash_attn=True)
    assert backend(tiny_model) == "triton"  # head_dim 16


@pytest.mark.parametrize("capability", [HOPPER, ADA])
def test_fp8_kv_cache_picks_triton(head_dim_128, pretend_gpu, capability):
    pretend_gpu(capability, flash_attn=True)
    assert backend(head_dim_128, kv_cache_dtype="fp8") == "triton"


def test_flash_attn_stays_selectable_by_name_on_hopper(head_dim_128, pretend_gpu):
    pretend_gpu(HOPPER, flash_attn=True)
    assert backend(head_dim_128, attention_backend="flash_attn") == "flash_attn"


def test_cpu_picks_torch(head_dim_128, pretend_gpu):
    pretend_gpu(HOPPER, flash_attn=True)
    assert backend(head_dim_128, device="cpu") == "torch"
