"""Qwen3 (dense): q/k RMSNorm per head before RoPE; biases only if `attention_bias`."""

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
