"""Writes a tiny safetensors checkpoint out as a GGUF file the way llama.cpp's converter does: GGUF
tensor names from gguf's own name map, Q/K rows of llama models permuted, the tokenizer and chat
template as metadata. Independent of nanovllm's GGUF reader, so that it can check it."""

import json
import os

import numpy as np
from safetensors.numpy import load_file

ARCHES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: each head's two halves interleaved row by row."""
    rows = weights.shape[0]
    per_head = weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weights.shape)


def write_tiny_gguf(checkpoint: str, path: str, qtype: str = "F32", arch: str | None = None,
                    extra_tensors: dict | None = None, extra_uint16: dict | None = None):
    """GGUF of the checkpoint directory at `path`: 2-D weights in `qtype` (F32 or Q8_0), 1-D in
    F32 (as llama.cpp keeps them); `arch` overrides general.architecture."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    gguf_arch = ARCHES[config["architectures"][0]]
    writer = gguf.GGUFWriter(path, arch or gguf_arch)
    _write_metadata(writer, config)
    _write_tokenizer(writer, checkpoint)
    for key, value in (extra_uint16 or {}).items():
        writer.add_uint16(key, value)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch.upper()],
                                        config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {}
    for file in sorted(os.listdir(checkpoint)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(checkpoint, file)))
    tensors.update(extra_tensors or {})
    for hf_name, weights in tensors.items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias")) or hf_name
        weights = weights.astype(np.float32)
        if gguf_arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            weights = llama_cpp_permute(weights, heads if ".q_proj." in hf_name else kv_heads)
        if qtype == "Q8_0" and weights.ndim == 2:
            quantized = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_metadata(writer, config: dict):
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer(writer, checkpoint: str):
    """The byte-level BPE of tiny_model.write_byte_tokenizer as llama.cpp's `gpt2` tokenizer."""
    with open(os.path.join(checkpoint, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = dict(tokenizer["model"]["vocab"])
    vocab.update({t["content"]: t["id"] for t in tokenizer["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    with open(os.path.join(checkpoint, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TOKEN_CONTROL if t in special else TOKEN_NORMAL for t in tokens])
    merges = [" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]]
    if merges:
        writer.add_token_merges(merges)
    else:  # transformers then derives merges from scores: none in a byte-per-token vocabulary
        writer.add_token_scores([0.0] * len(tokens))
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(vocab[tokenizer_config["pad_token"]])
    template = tokenizer_config.get("chat_template")
    if template is None:
        with open(os.path.join(checkpoint, "chat_template.jinja")) as f:
            template = f.read()
    writer.add_chat_template(template)
