"""What RL trainers colocated with vLLM reach for inside `llm.llm_engine`: `model_config`, and the
weight path `model_executor.driver_worker(.worker).model_runner.model.load_weights(pairs)`, here
a front for `update_weights` (checked, on every tensor-parallel rank, prefix cache reset)."""

import weakref
from dataclasses import dataclass
from types import SimpleNamespace


@dataclass(frozen=True)
class ModelConfig:
    """vLLM's ModelConfig, the fields trainers read."""

    model: str
    tokenizer: str
    max_model_len: int
    hf_config: object
    dtype: object  # a torch.dtype
    seed: int | None

    @classmethod
    def of(cls, config) -> "ModelConfig":
        return cls(config.model, config.tokenizer or config.model, config.max_model_len,
                   config.hf_config, config.torch_dtype, config.seed)

    @property
    def hf_text_config(self):
        return self.hf_config

    def get_vocab_size(self) -> int:
        return self.hf_config.vocab_size


class WeightLoader:
    """`model.load_weights(pairs)` as vLLM's models take it: (Hugging Face name, full tensor) pairs,
    any subset; returns the names loaded."""

    def __init__(self, engine):
        self.engine = weakref.proxy(engine)  # the engine holds this: no cycle keeps it alive

    def load_weights(self, weights) -> set[str]:
        pairs = list(weights)
        self.engine.update_weights(pairs)
        return {name for name, _ in pairs}


class ModelExecutor:
    """`model_executor.driver_worker.model_runner.model` (and verl's
    `driver_worker.worker.model_runner.model`): a WeightLoader."""

    def __init__(self, engine):
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=WeightLoader(engine)))
        worker.worker = worker
        self.driver_worker = worker
