"""Llama 2 / 3 / 3.1 / 3.2 (3.1+ with the `llama3` RoPE scaling of layers/rotary_embedding.py)."""

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias)
