"""Qwen2 and Qwen2.5: bias on q/k/v_proj (not o_proj), no q/k norm, head_dim = hidden / heads."""

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)
