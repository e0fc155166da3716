"""GGUF checkpoints (llama.cpp's format) as another source of weights: the HF config built from the
metadata, the tensors dequantized under their HF names, the tokenizer read from the file."""

import functools
import os
from collections.abc import Iterator

import numpy as np
import torch

from nanovllm.extras import import_extra

# general.architecture -> the HF architecture that runs it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}
# blk.{i}.<key> -> model.layers.{i}.<value>
LAYER_TENSORS = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                 "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                 "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
REQUIRED = object()
GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 2, 3, 8  # ggml type ids
BLOCK_BYTES = {GGML_Q4_0: 18, GGML_Q4_1: 20, GGML_Q8_0: 34}  # per block of 32 values


def _import_gguf(path: str):
    return import_extra("gguf", "gguf",
                        f"{path!r} is a GGUF file; reading it needs the gguf package")


def open_gguf(path: str):
    """The file's GGUFReader (memory-mapped; the last one kept for config, weights, tokenizer)."""
    stat = os.stat(path)
    return _reader(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _reader(path: str, size: int, mtime_ns: int):
    gguf = _import_gguf(path)
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader's ValueError / IndexError on short or foreign bytes
        raise ValueError(f"cannot read {path!r}: truncated or not a GGUF file ({e})") from None


def metadata(reader, key: str, path: str, default=REQUIRED):
    field = reader.fields.get(key)
    if field is None:
        if default is REQUIRED:
            raise ValueError(f"{path!r} lacks the GGUF metadata key {key!r}")
        return default
    return field.contents()


def architecture(reader, path: str) -> str:
    arch = metadata(reader, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path!r}; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return arch


def gguf_config_fields(path: str) -> dict:
    """The config.json fields of the model in a GGUF file, from its metadata and tensor names."""
    reader = open_gguf(path)
    arch = architecture(reader, path)
    if metadata(reader, "split.count", path, 1) > 1:
        raise ValueError(f"{path!r} is one part of a split GGUF, which is not supported; merge "
                         "the parts into one file (llama.cpp's llama-gguf-split --merge)")
    names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError(f"{path!r} has no token_embd.weight tensor")
    _reject_rope_scaling(reader, arch, names, path)

    def get(key, default=REQUIRED):
        return metadata(reader, f"{arch}.{key}", path, default)

    heads = get("attention.head_count")
    fields = dict(
        architectures=[ARCHITECTURES[arch]], model_type=arch,
        vocab_size=int(embedding.shape[1]),  # GGUF shapes are [columns, rows]
        hidden_size=get("embedding_length"), intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"), num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_parameters=dict(rope_type="default", rope_theta=get("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names)
    fields["head_dim"] = get("attention.key_length", fields["hidden_size"] // heads)
    if arch == "llama":
        fields["attention_bias"] = "blk.0.attn_q.bias" in names
        fields["mlp_bias"] = "blk.0.ffn_up.bias" in names
    for name in ("bos", "eos", "padding"):
        token = metadata(reader, f"tokenizer.ggml.{name}_token_id", path, None)
        if token is not None:
            fields["pad_token_id" if name == "padding" else f"{name}_token_id"] = token
    return fields


def _reject_rope_scaling(reader, arch: str, names: set, path: str):
    """The decoder's RoPE is the default one here: refuse files that ask for another."""
    scaling = metadata(reader, f"{arch}.rope.scaling.type", path, "none")
    if scaling != "none":
        raise ValueError(f"RoPE scaling {scaling!r} in {path!r} is not supported for GGUF files")
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path!r} carries rope_freqs (llama3 RoPE scaling as a tensor), which "
                         "is not supported for GGUF files; use the safetensors checkpoint")
    dims = metadata(reader, f"{arch}.rope.dimension_count", path, None)
    key_length = metadata(reader, f"{arch}.attention.key_length", path, None)
    heads = metadata(reader, f"{arch}.attention.head_count", path)
    head_dim = key_length or metadata(reader, f"{arch}.embedding_length", path) // heads
    if dims is not None and dims != head_dim:
        raise ValueError(f"{path!r} rotates {dims} of {head_dim} head dimensions: partial "
                         "rotary embeddings are not supported")



def gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for each tensor of the file, dequantized, in HF layout."""
    gguf = _import_gguf(path)
    reader = open_gguf(path)
    fields = gguf_config_fields(path)
    llama = fields["model_type"] == "llama"
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, path)
        weights = dequantize(gguf, tensor, path).reshape([int(d) for d in reversed(tensor.shape)])
        if llama and (".q_proj." in name or ".k_proj." in name):
            heads = fields["num_attention_heads" if ".q_proj." in name else "num_key_value_heads"]
            weights = unpermute_rope_rows(weights, heads)
        # a writable float32 copy where the array is still a view into the read-only file
        yield name, torch.from_numpy(np.require(weights, np.float32, ["C", "W"]))


def dequantize(gguf, tensor, path: str) -> np.ndarray:
    """float32 [rows, columns]: Q4_0, Q4_1 and Q8_0 (llama.cpp's common types) by torch over the
    whole tensor, on every core; other types by gguf's numpy code."""
    if tensor.tensor_type in BLOCK_BYTES:
        return _dequantize_q4_q8(torch.from_numpy(np.array(tensor.data)), tensor.tensor_type)
    kind = gguf.GGMLQuantizationType(tensor.tensor_type)
    try:
        return gguf.quants.dequantize(tensor.data, kind)
    except NotImplementedError:
        raise ValueError(f"tensor {tensor.name!r} in {path!r} has type {kind.name}, which "
                         "gguf cannot dequantize") from None


def _dequantize_q4_q8(rows: torch.Tensor, kind: int) -> np.ndarray:
    """gguf's formulas, in its order of operations (so the floats are the same): blocks of 32
    values, each a float16 scale d (Q4_1: and a float16 offset m) then 4- or 8-bit quants."""
    blocks = rows.reshape(-1, BLOCK_BYTES[kind])
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    if kind == GGML_Q8_0:
        values = blocks[:, 2:].contiguous().view(torch.int8).float() * d
    else:
        packed = blocks[:, -16:]  # value i in the low nibble of byte i, value 16 + i in the high
        quants = torch.cat([packed & 0x0F, packed >> 4], dim=1)
        if kind == GGML_Q4_0:
            values = d * (quants.to(torch.int8) - 8).float()
        else:
            values = d * quants.float() + blocks[:, 2:4].contiguous().view(torch.float16).float()
    return values.reshape(rows.shape[0], -1).numpy()


def hf_tensor_name(gguf_name: str, path: str) -> str:
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in {path!r}: no such parameter in "
                     "the supported architectures")


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: a head's rows [head_dim / 2, 2] -> HF's [2, head_dim / 2]."""
    rows = weights.shape[0]
    per_head = weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weights.shape)


def gguf_tokenizer(path: str):
    """The tokenizer (and chat template) stored in the GGUF file, built by transformers."""
    reader = open_gguf(path)
    if "tokenizer.ggml.model" not in reader.fields:
        raise FileNotFoundError(f"no tokenizer in {path!r}; pass skip_tokenizer_init=True to give "
                                "prompts as token ids")
    # The fast tokenizer class directly: AutoTokenizer first builds a config from the file's
    # metadata with gguf's slow reader (seconds) only to pick this same class.
    from transformers import PreTrainedTokenizerFast

    folder, name = os.path.split(path)
    try:
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise ValueError(f"cannot load the tokenizer of {path!r}: {e}") from e
