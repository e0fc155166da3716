"""nanovllm: a small offline-inference engine. `from nanovllm import LLM, SamplingParams`."""

from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; importing it lazily keeps `import nanovllm.engine.scheduler` light.
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
