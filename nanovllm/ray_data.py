"""Ray Data: a dataset of prompts into a dataset of completions through a pool of engine actors
(README.md, "Data parallel on Ray"). The dataset streams, so it may be larger than memory."""

import numpy as np

from nanovllm.ray.data_parallel import replica_resources
from nanovllm.ray.replica import import_ray


class LLMPredictor:
    """A callable class for `Dataset.map_batches`: each actor of the pool holds one `LLM`, and a
    batch (a dict of numpy columns) comes back with three columns more."""

    def __init__(self, model: str, sampling_params, prompt_column: str, options: dict):
        from nanovllm.llm import LLM

        self.llm = LLM(model, **options)
        self.sampling_params = sampling_params
        self.prompt_column = prompt_column

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        prompts = [p if isinstance(p, str) else np.asarray(p).tolist()
                   for p in batch[self.prompt_column]]
        outputs = self.llm.generate(prompts, self.sampling_params, use_tqdm=False)
        token_ids = np.empty(len(outputs), dtype=object)  # ragged: one list per row
        token_ids[:] = [o["token_ids"] for o in outputs]
        return {**batch,
                "generated_text": np.array([o["text"] for o in outputs], dtype=object),
                "generated_token_ids": token_ids,
                "finish_reason": np.array([o["finish_reason"] for o in outputs], dtype=object)}


def generate_dataset(dataset, model: str, sampling_params, *, prompt_column: str = "prompt",
                     num_replicas: int = 1, batch_size: int = 256, **options):
    """`dataset` (a `ray.data.Dataset` whose `prompt_column` holds str or token-id prompts) with
    each row's completion, by `num_replicas` engine actors (`LLM(model, **options)` each, with
    `tensor_parallel_size` GPUs). Lazy, as every Dataset: it runs when consumed."""
    ray = import_ray("generate_dataset")
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if prompt_column not in dataset.columns():
        raise ValueError(f"the dataset has no column {prompt_column!r}; its columns are "
                         f"{dataset.columns()}")
    if not ray.is_initialized():
        ray.init()
    device, resources = replica_resources(ray, options)
    return dataset.map_batches(
        LLMPredictor, batch_size=batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=num_replicas),
        fn_constructor_kwargs=dict(model=model, sampling_params=sampling_params,
                                   prompt_column=prompt_column,
                                   options={**options, "device": device}), **resources)
