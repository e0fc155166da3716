"""EngineReplica: one engine inside a Ray actor, driven by DataParallelLLM (data_parallel.py)."""

from nanovllm.extras import import_extra


def import_ray(what: str):
    return import_extra("ray", "ray", f"{what} needs Ray, which is not installed")


class EngineReplica:
    """A Ray actor holding one `LLM`; threaded, so that concurrent shards share its steps."""

    def __init__(self):
        self.llm = None
        self.received = self.completed = 0

    def start(self, model: str, options: dict) -> tuple[int, int, int]:
        """Build the engine (errors come back as themselves); returns (max_model_len,
        kvcache_block_size, num_kvcache_blocks), what a request must fit."""
        from nanovllm.llm import LLM

        self.llm = LLM(model, **options)
        config = self.llm.config
        return config.max_model_len, config.kvcache_block_size, self.llm.num_kvcache_blocks

    def generate(self, prompts: list[list[int]], sampling_params: list):
        """Stream a shard: (index in the shard, output) as each prompt completes."""
        self.received += len(prompts)
        for completed in self.llm.as_completed(prompts, sampling_params):
            yield completed
            self.completed += 1

    def progress(self) -> tuple[int, int]:
        """(prompts received, prompts yielded) since start."""
        return self.received, self.completed

    def call(self, method: str, args: tuple, kwargs: dict):
        """Run `LLM.<method>(*args, **kwargs)`: the broadcast of DataParallelLLM."""
        if not hasattr(self.llm, method):
            raise AttributeError(f"the engine has no method {method!r}")
        return getattr(self.llm, method)(*args, **kwargs)

    def exit(self):
        if self.llm is not None:
            self.llm.exit()
