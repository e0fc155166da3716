"""A checkpoint's model config: config.json (or a GGUF's metadata) read with clear errors, and the
fields the decoder is built from."""

import json
import os
from collections.abc import Collection

SUPPORTED_ROPE_TYPES = ("default", "llama3")
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "max_position_embeddings")
OPTIONAL_FIELDS = ("num_key_value_heads", "head_dim")


def head_dim(hf_config) -> int:
    if getattr(hf_config, "head_dim", None):
        return hf_config.head_dim
    return hf_config.hidden_size // hf_config.num_attention_heads


def rope_parameters(hf_config) -> dict:
    """The checkpoint's RoPE settings with `rope_type` and `rope_theta`, from `rope_parameters`
    (transformers >= 5) or `rope_scaling` and a top-level `rope_theta`."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _check_model_features(hf_config, path: str):
    """Reject what the shared decoder does not implement, rather than compute something else."""
    rope = rope_parameters(hf_config)
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope['rope_type']!r} in {path!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']} in {path!r} "
                         "is not supported")
    activation = getattr(hf_config, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"hidden_act={activation!r} in {path!r} is not supported; "
                         "supported: 'silu'")
    layer_types = getattr(hf_config, "layer_types", None)
    sliding = (any(t != "full_attention" for t in layer_types) if layer_types
               else getattr(hf_config, "use_sliding_window", False))
    if sliding:
        raise ValueError(f"{path!r} uses sliding-window attention, which is not supported")


def load_hf_config(model: str, architectures: Collection[str]):
    """Read config.json of a checkpoint directory (or a GGUF's metadata), with clear errors for what
    is missing; the checkpoint must name one of `architectures`."""
    if model.endswith(".gguf") and os.path.isfile(model):
        from transformers import AutoConfig

        from nanovllm.checkpoint.gguf import gguf_config_fields

        fields = gguf_config_fields(model)
        _check_required_fields(fields, f"the metadata of {model!r}")
        hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        _check_model_features(hf_config, model)
        return hf_config
    if not os.path.isdir(model):
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r} not found: a checkpoint directory needs a config.json")
    raw = _read_config_json(path)
    named = raw.get("architectures") or []
    if not any(arch in architectures for arch in named):
        raise ValueError(f"unsupported architecture {named} in {path!r}; "
                         f"supported: {', '.join(architectures)}")
    _check_required_fields(raw, repr(path))
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(model)
    except Exception as e:  # transformers' own validation of the fields' types
        raise ValueError(f"{path!r} is not a valid model config: {e}") from e
    _check_model_features(hf_config, path)
    return hf_config


def _read_config_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path!r} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _check_required_fields(raw: dict, where: str):
    """The shape fields the model is built from: present, and positive ints."""
    missing = [name for name in REQUIRED_FIELDS if name not in raw]
    if missing:
        raise ValueError(f"{where} is missing required field(s): {', '.join(missing)}")
    for name in (*REQUIRED_FIELDS, *OPTIONAL_FIELDS):
        value = raw.get(name)
        if value is None and name in OPTIONAL_FIELDS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} in {where} must be a positive int")
