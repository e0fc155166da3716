"""Strict safetensors loading: every parameter loaded exactly once, anything else is an error."""

import glob
import os

from safetensors import SafetensorError, safe_open
from torch import nn


def load_model(model: nn.Module, path: str):
    """Load `path`/*.safetensors (or the .gguf file `path`) through each parameter's
    `weight_loader`; packed projections are routed by `model.packed_modules_mapping`; with tied
    embeddings `lm_head.weight` is skipped."""
    packed = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    params = dict(model.named_parameters(remove_duplicate=True))
    loaded = set()
    for file, ckpt_name, tensor in _checkpoint_tensors(path):
        if tied and ckpt_name == "lm_head.weight":
            continue
        name, shard = _route(ckpt_name, packed)
        if name not in params:
            raise ValueError(f"unexpected tensor {ckpt_name!r} in {file!r}: "
                             "the model has no such parameter")
        if (name, shard) in loaded:
            raise ValueError(f"tensor {ckpt_name!r} appears more than once in {path!r}")
        _load_tensor(params[name], tensor, shard, f"{ckpt_name!r} from {file!r}")
        loaded.add((name, shard))
    missing = sorted(f"{n}" + (f" (shard {s!r})" if s is not None else "")
                     for n, s in _expected_keys(params, packed) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing tensors for: {', '.join(missing)}")


def _checkpoint_tensors(path: str):
    """(file, checkpoint name, tensor) for every tensor of the checkpoint, read one at a time."""
    if path.endswith(".gguf"):
        from nanovllm.utils.gguf_checkpoint import gguf_weights

        yield from ((path, name, tensor) for name, tensor in gguf_weights(path))
        return
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                yield file, name, f.get_tensor(name)


def _open(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise ValueError(f"cannot read {file!r}: truncated or not a safetensors file "
                         f"({e})") from None


def _load_tensor(param: nn.Parameter, tensor, shard, where: str):
    args = (param, tensor) if shard is None else (param, tensor, shard)
    try:
        param.weight_loader(*args) if hasattr(param, "weight_loader") else _default_loader(*args)
    except ValueError as e:
        raise ValueError(f"cannot load {where}: {e}") from None


def _expected_keys(params: dict, packed: dict) -> set[tuple[str, object]]:
    """(parameter name, shard id) pairs that must each be loaded once; shard is None if unpacked."""
    shards_of: dict[str, list] = {}
    for dst, shard in packed.values():
        shards_of.setdefault(dst, []).append(shard)
    expected = set()
    for name in params:
        module = name.split(".")[-2] if "." in name else ""
        expected.update((name, shard) for shard in shards_of.get(module, [None]))
    return expected


def _route(ckpt_name: str, packed: dict) -> tuple[str, object]:
    for src, (dst, shard) in packed.items():
        if f".{src}." in ckpt_name:
            return ckpt_name.replace(f".{src}.", f".{dst}."), shard
    return ckpt_name, None


def _default_loader(param: nn.Parameter, loaded):
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: expected {tuple(param.shape)}, "
                         f"checkpoint has {tuple(loaded.shape)}")
    param.data.copy_(loaded)
