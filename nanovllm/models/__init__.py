"""Model registry: config.json's `architectures` name -> its class (Qwen2 serves Qwen2.5 too)."""

from torch import nn

from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(hf_config) -> type[nn.Module]:
    """The class of the first of the checkpoint's `architectures` that we implement."""
    architectures = getattr(hf_config, "architectures", None) or []
    for arch in architectures:
        if arch in MODELS:
            return MODELS[arch]
    raise ValueError(f"unsupported architecture {architectures}; supported: {', '.join(MODELS)}")
