"""Llama 2 / 3 / 3.1 / 3.2: no q/k norm, biases only if `attention_bias` / `mlp_bias`; Llama 3.1+
checkpoints use the `llama3` RoPE scaling (built in layers/rotary_embedding.py)."""

from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))
