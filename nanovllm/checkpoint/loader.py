"""Strict checkpoint loading (safetensors, or GGUF through gguf_checkpoint.py): every parameter
loaded exactly once, anything else is an error."""

import glob
import os
from collections.abc import Iterable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

EMBEDDING = "model.embed_tokens.weight"


Weights = Iterable[tuple[str, torch.Tensor]]  # (checkpoint / HF name, full unsharded tensor)


def load_model(model: nn.Module, path: str, dummy: bool = False) -> dict[str, tuple[int, ...]]:
    """Load every tensor of `path`/*.safetensors or the .gguf file `path` (all required); returns
    each name's shape. dummy: small random values of the checkpoint's shapes instead (vLLM's
    load_format="dummy"), for update_weights to fill."""
    if dummy:
        if path.endswith(".gguf"):
            raise ValueError("load_format='dummy' takes a safetensors checkpoint, not a GGUF file")
        generator = torch.Generator().manual_seed(0)
        return load_weights(model, ((name, torch.empty(shape).uniform_(-0.05, 0.05,
                                                                      generator=generator))
                                    for name, shape in checkpoint_specs(path)))
    if path.endswith(".gguf"):
        from nanovllm.checkpoint.gguf import gguf_weights

        try:
            return load_weights(model, gguf_weights(path))
        except ValueError as e:
            raise ValueError(f"{e} (in {path!r})") from None
    files = _files(path)
    reading = [""]

    def tensors() -> Weights:
        for file in files:
            reading[0] = file
            with _open(file) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    try:
        return load_weights(model, tensors())
    except ValueError as e:
        raise ValueError(f"{e} (in {reading[0]!r})") from None


def load_weights(model: nn.Module, weights: Weights,
                 complete: bool = True) -> dict[str, tuple[int, ...]]:
    """Copy each (name, tensor) in place through its parameter's `weight_loader` (TP sharding);
    packed projections are routed by `model.packed_modules_mapping` (or the model's
    `route_weight`, e.g. per-expert tensors into stacked experts); with tied embeddings
    `lm_head.weight` is skipped. complete: every parameter must be loaded, each exactly once.
    Returns each loaded name's shape (with tied embeddings, lm_head.weight's too)."""
    packed = getattr(model, "packed_modules_mapping", {})
    route = getattr(model, "route_weight", None)
    tied = getattr(model, "tie_word_embeddings", False)
    params = dict(model.named_parameters(remove_duplicate=True))
    loaded, shapes = set(), {}
    for ckpt_name, tensor in weights:
        shapes[ckpt_name] = tuple(tensor.shape)
        if tied and ckpt_name == "lm_head.weight":
            continue
        name, shard = (route and route(ckpt_name)) or _route(ckpt_name, packed)
        if name not in params:
            raise ValueError(f"unexpected tensor {ckpt_name!r}: the model has no such parameter")
        if (name, shard) in loaded:
            raise ValueError(f"tensor {ckpt_name!r} appears more than once")
        _load_tensor(params[name], tensor, shard, repr(ckpt_name))
        loaded.add((name, shard))
    missing = sorted(f"{n}" + (f" (shard {s!r})" if s is not None else "")
                     for n, s in _expected_keys(params, packed) - loaded)
    if complete and missing:
        raise ValueError(f"missing tensors for: {', '.join(missing)}")
    if tied and EMBEDDING in shapes:
        shapes.setdefault("lm_head.weight", shapes[EMBEDDING])
    return shapes


def checkpoint_specs(path: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each tensor of `path`/*.safetensors, from the headers alone."""
    specs = []
    for file in _files(path):
        with _open(file) as f:
            specs += [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]
    return specs


def checkpoint_tensors(path: str) -> Weights:
    """(name, tensor) of each tensor of `path`/*.safetensors, read one at a time."""
    for file in _files(path):
        with _open(file) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def check_weights(shapes: dict[str, tuple[int, ...]], specs: list[tuple[str, tuple]]):
    """Raise ValueError unless each (name, shape) names a distinct tensor of the checkpoint the
    model was loaded from, with its shape (`shapes`, as load_weights returned them)."""
    seen = set()
    for name, shape in specs:
        if not isinstance(name, str) or name not in shapes:
            raise ValueError(f"unknown weight {name!r}: the checkpoint has no such tensor "
                             f"(names as in its state_dict(), e.g. {next(iter(shapes))!r})")
        if name in seen:
            raise ValueError(f"weight {name!r} is given more than once")
        seen.add(name)
        if tuple(shape) != shapes[name]:
            raise ValueError(f"weight {name!r} has shape {tuple(shape)}, the checkpoint's has "
                             f"{shapes[name]}")


def _files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    return files


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
    for name, param in params.items():
        module = name.split(".")[-2] if "." in name else ""
        shards = getattr(param, "shard_ids", None) or shards_of.get(module, [None])
        expected.update((name, shard) for shard in shards)
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


def weight_pairs(weights, tied: bool = False) -> list[tuple[str, torch.Tensor]]:
    """A state dict or (name, tensor) pairs as checked pairs: every tensor a dense floating-point
    tensor with data. With tied embeddings, lm_head.weight is the embedding: it is loaded as
    model.embed_tokens.weight, and must equal it when both are given."""
    pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"weights[{i}] must be a (name, tensor) pair, got "
                            f"{type(pair).__name__}")
        _check_tensor(*pair)
    if not tied:
        return pairs
    named = dict(pairs)
    head = named.get("lm_head.weight")
    if head is not None and EMBEDDING in named and (
            head.shape != named[EMBEDDING].shape
            or not torch.equal(head, named[EMBEDDING].to(head.device))):
        raise ValueError("lm_head.weight differs from model.embed_tokens.weight, but the "
                         "checkpoint ties them (tie_word_embeddings): give one tensor")
    if head is not None:  # one tensor of the two: the embedding's
        pairs = [(EMBEDDING, t) if name == "lm_head.weight" else (name, t)
                 for name, t in pairs if not (name == "lm_head.weight" and EMBEDDING in named)]
    return pairs


def _check_tensor(name, tensor):
    where = f"weight {name!r}"
    if not isinstance(name, str):
        raise TypeError(f"a weight's name must be a str, got {name!r}")
    if tensor is None:
        raise TypeError(f"{where} is None, not a tensor")
    if not isinstance(tensor, torch.Tensor):
        hint = " (torch.from_numpy makes one)" if hasattr(tensor, "__array__") else ""
        raise TypeError(f"{where} is a {type(tensor).__name__}, not a torch.Tensor{hint}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{where} is a {tensor.layout} tensor: pass a dense one (.to_dense())")
    if tensor.is_meta:
        raise ValueError(f"{where} is on the meta device: it has no data")
    if not tensor.is_floating_point():
        raise TypeError(f"{where} has dtype {tensor.dtype}: weights are real floating point")
