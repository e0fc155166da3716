"""Random-weight checkpoints (Qwen3, Qwen3-MoE, Qwen2, Llama) written by transformers, so that the
engine can be checked token for token against transformers on the same weights."""

import json
import os

# A byte-level vocabulary plus special tokens, padded to a size every TP size up to 8 divides.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 320
# Qwen3's layout, shortened: the tools listed in a system turn, an assistant's calls in Hermes
# <tool_call> blocks, a tool's answer in a user turn; enable_thinking=False (a
# chat_template_kwargs entry) opens the assistant's turn with an empty think block.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}\n<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)

# Published architectures (the fields of their config.json).
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                tie_word_embeddings=False)
QWEN2_5_0_5B = dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896,
                    intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                    rope_theta=1000000.0, tie_word_embeddings=True)
LLAMA_3_2_1B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
                    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, rope_theta=500000.0,
                    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=8192),
                    tie_word_embeddings=True)
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)
SMOLLM2_135M = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True)


def write_byte_tokenizer(path: str, vocab_size: int = TINY_VOCAB_SIZE):
    """A byte-level BPE tokenizer without merges (one token per byte) plus the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    num_extra = vocab_size - len(vocab) - len(SPECIAL_TOKENS)
    specials = SPECIAL_TOKENS + [f"<|extra_{i}|>" for i in range(num_extra)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def _transformers_classes(architecture: str):
    import transformers

    config_names = {"Qwen3ForCausalLM": "Qwen3Config", "Qwen2ForCausalLM": "Qwen2Config",
                    "LlamaForCausalLM": "LlamaConfig", "Qwen3MoeForCausalLM": "Qwen3MoeConfig"}
    if architecture not in config_names:
        raise ValueError(f"no random-checkpoint writer for {architecture!r}; "
                         f"known: {', '.join(config_names)}")
    return getattr(transformers, config_names[architecture]), getattr(transformers, architecture)


def write_random_checkpoint(path: str, arch: dict, dtype: str = "float32", seed: int = 0,
                            initializer_range: float = 0.02, tokenizer: bool = True):
    """Save a random model of `arch` (config.json fields) to `path`, its biases drawn like its
    weights (not zero) so that a wrongly loaded bias shows."""
    import torch

    architecture, config, model_class = _transformers_config(arch, initializer_range)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = model_class(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, initializer_range)
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    _write_companions(path, config, tokenizer)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == [architecture]


def write_benchmark_checkpoint(path: str, arch: dict, dtype: str = "bfloat16", seed: int = 0,
                               initializer_range: float = 0.02, shard_bytes: int = 4 << 30):
    """Random weights for benchmarks, drawn tensor by tensor as transformers initializes them,
    saved in indexed shards of about `shard_bytes`."""
    import torch
    from safetensors.torch import save_file

    _, config, model_class = _transformers_config(arch, initializer_range)
    with torch.device("meta"):
        shapes = _checkpoint_shapes(model_class(config).state_dict())
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # tied, as save_pretrained writes it
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    os.makedirs(path, exist_ok=True)
    shard, size, index, weight_map, total = {}, 0, 0, {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        if name.endswith("norm.weight"):
            shard[name] = torch.ones(shape, dtype=torch_dtype)
        elif name.endswith(".bias"):
            shard[name] = torch.zeros(shape, dtype=torch_dtype)
        else:
            drawn = torch.empty(shape).normal_(0.0, initializer_range, generator=generator)
            shard[name] = drawn.to(torch_dtype)
        size += shard[name].nbytes
        if size >= shard_bytes or i == len(shapes) - 1:
            file = f"model-{index:05d}.safetensors"
            save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, total, size, index = {}, total + size, 0, index + 1
    if index > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config.dtype = dtype  # what `dtype="auto"` then runs in
    config.save_pretrained(path)
    _write_companions(path, config, tokenizer=True)


def _checkpoint_shapes(state_dict: dict) -> dict:
    """Tensor shapes as save_pretrained writes them: stacked experts ([E, 2I, H] gate_up_proj and
    [E, H, I] down_proj) as per-expert gate_proj, up_proj and down_proj, like the hub's files."""
    shapes = {}
    for name, tensor in state_dict.items():
        prefix, _, last = name.rpartition(".")
        if not prefix.endswith(".experts"):
            shapes[name] = tensor.shape
            continue
        num_experts, rows, cols = tensor.shape
        for e in range(num_experts):
            if last == "down_proj":
                shapes[f"{prefix}.{e}.down_proj.weight"] = (rows, cols)
            else:
                shapes[f"{prefix}.{e}.gate_proj.weight"] = (rows // 2, cols)
                shapes[f"{prefix}.{e}.up_proj.weight"] = (rows // 2, cols)
    return shapes


def _transformers_config(arch: dict, initializer_range: float):
    """(architecture, config, model class): `architectures` picks the family (Qwen3 if absent)."""
    arch = dict(arch)
    (architecture,) = arch.pop("architectures", ["Qwen3ForCausalLM"])
    config_class, model_class = _transformers_classes(architecture)
    rope = {"rope_type": "default", **arch.pop("rope_scaling", {}),
            "rope_theta": arch.pop("rope_theta", 1000000.0)}
    config = config_class(**arch, initializer_range=initializer_range, rope_parameters=rope,
                          bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index("<|im_end|>") + 256,
                          pad_token_id=256)
    config.architectures = [architecture]
    return architecture, config, model_class


def _write_companions(path: str, config, tokenizer: bool):
    from transformers import GenerationConfig

    GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=256).save_pretrained(path)
    if tokenizer:
        vocab_size = config.vocab_size if config.vocab_size <= 4096 else TINY_VOCAB_SIZE
        write_byte_tokenizer(path, vocab_size)


def write_random_qwen3(path: str, arch: dict, dtype: str = "float32", seed: int = 0,
                       initializer_range: float = 0.02, tokenizer: bool = True):
    write_random_checkpoint(path, {"architectures": ["Qwen3ForCausalLM"], **arch}, dtype=dtype,
                            seed=seed, initializer_range=initializer_range, tokenizer=tokenizer)


def write_tiny_qwen3(path: str, dtype: str = "float32", seed: int = 0, **arch_overrides):
    """The test oracle's checkpoint: weights of std 0.3 so that greedy tokens vary and the top-2
    logit gaps (~1e-2) dwarf float32 rounding differences."""
    write_random_qwen3(path, tiny_qwen3_arch(**arch_overrides), dtype=dtype, seed=seed,
                       initializer_range=0.3)


def tiny_qwen3_arch(**overrides) -> dict:
    """A 2-layer Qwen3 small enough for CPU tests (GQA 4:2, head_dim 16)."""
    arch = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
                tie_word_embeddings=True)
    arch.update(overrides)
    return arch


def write_tiny_qwen2(path: str, dtype: str = "float32", seed: int = 0, **arch_overrides):
    """write_tiny_qwen3's Qwen2 twin (q/k/v biases, no q/k norm, no head_dim: hidden / heads)."""
    arch = tiny_qwen3_arch(architectures=["Qwen2ForCausalLM"])
    del arch["head_dim"]
    arch.update(arch_overrides)
    write_random_checkpoint(path, arch, dtype=dtype, seed=seed, initializer_range=0.3)


def write_tiny_llama(path: str, dtype: str = "float32", seed: int = 0, **arch_overrides):
    """A tiny Llama 3.1: of head_dim 16's 8 frequencies (wavelengths 6 .. 2e4) its llama3 scaling
    (original 256) keeps 3 (below 256 / 4), blends 1 and divides 4 by the factor (above 256)."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=256)
    arch = tiny_qwen3_arch(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
                           rope_scaling=scaling)
    arch.update(arch_overrides)
    write_random_checkpoint(path, arch, dtype=dtype, seed=seed, initializer_range=0.3)


def write_tiny_qwen3_moe(path: str, dtype: str = "float32", seed: int = 0, **arch_overrides):
    """A 3-layer Qwen3-MoE: 8 experts, top-2 (renormalized), layer 1 dense (`mlp_only_layers`)."""
    arch = tiny_qwen3_arch(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=3,
                           intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                           mlp_only_layers=[1])
    arch.update(arch_overrides)
    write_random_checkpoint(path, arch, dtype=dtype, seed=seed, initializer_range=0.3)
