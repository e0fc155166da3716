"""Write small random Qwen3 checkpoints with transformers, for tests, examples and benchmarks.

The weights are random, so generated text is meaningless; what matters is that transformers wrote
them, so our engine can be checked token for token against transformers on the same weights.
"""

import json
import os

# Byte-level tokenizer: one token per byte, then special tokens, padded to a vocabulary size that
# every tensor-parallel size up to 8 divides.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 320
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-0.6B's published architecture (config.json of Qwen/Qwen3-0.6B).
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
# Qwen3-8B's published architecture.
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)


def write_byte_tokenizer(path: str, vocab_size: int = TINY_VOCAB_SIZE):
    """A byte-level BPE tokenizer without merges (each byte is a token) plus chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    specials = SPECIAL_TOKENS + [f"<|extra_{i}|>" for i in range(vocab_size - len(vocab) - len(SPECIAL_TOKENS))]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def write_random_qwen3(path: str, arch: dict, dtype: str = "float32", seed: int = 0,
                       initializer_range: float = 0.02, tokenizer: bool = True):
    """Save a random-weight Qwen3ForCausalLM with architecture `arch` (config fields) to `path`."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    os.makedirs(path, exist_ok=True)
    arch = dict(arch)
    rope_theta = arch.pop("rope_theta", 1000000.0)
    config = Qwen3Config(**arch, initializer_range=initializer_range, rope_parameters={"rope_type": "default",
                         "rope_theta": rope_theta}, bos_token_id=None, eos_token_id=SPECIAL_TOKENS.index("<|im_end|>")
                         + 256, pad_token_id=256)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=256).save_pretrained(path)
    if tokenizer:
        write_byte_tokenizer(path, arch["vocab_size"] if arch["vocab_size"] <= 4096 else TINY_VOCAB_SIZE)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3ForCausalLM"]


def write_tiny_qwen3(path: str, dtype: str = "float32", seed: int = 0, **arch_overrides):
    """The test oracle's checkpoint. Weights drawn with std 0.3 (not 0.02) so greedy decoding varies
    its tokens and the top-2 logit gaps (~1e-2) dwarf float32 rounding differences."""
    write_random_qwen3(path, tiny_qwen3_arch(**arch_overrides), dtype=dtype, seed=seed, initializer_range=0.3)


def tiny_qwen3_arch(**overrides) -> dict:
    """A 2-layer Qwen3 small enough for CPU tests (GQA 4:2, head_dim 16)."""
    arch = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
    arch.update(overrides)
    return arch
