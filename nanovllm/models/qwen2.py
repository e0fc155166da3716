from nanovllm.models.decoder import DecoderForCausalLM, DecoderOptions


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True)
