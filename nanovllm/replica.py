"""EngineReplica: one engine inside a Ray actor, driven by DataParallelLLM (data_parallel.py)."""

import functools


def import_ray(what: str):
    """The `ray` module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError(f"{what} needs Ray, which is not installed: "
                          "pip install 'nanovllm[ray]'") from None
    return ray


class _Counter:
    """A tqdm stand-in for LLMEngine.generate: keeps `n` (finished requests) in `counts[key]`."""

    def __init__(self, counts: dict, key: int, **tqdm_options):
        self._counts, self._key = counts, key
        counts[key] = 0

    @property
    def n(self) -> int:
        return self._counts.get(self._key, 0)

    @n.setter
    def n(self, value: int):
        self._counts[self._key] = value

    def set_postfix(self, *args, **kwargs):
        pass

    def close(self):
        pass


class EngineReplica:
    """The body of a Ray actor holding one `LLM`. Threaded (max_concurrency > 1): calls of
    several batches share the engine's steps, and `progress` answers while they run."""

    def __init__(self):
        self.llm = None
        self.counts: dict[int, int] = {}  # call id -> requests of that call finished

    def start(self, model: str, options: dict) -> tuple[int, int, int]:
        """Build the engine (errors come back as themselves); returns (max_model_len,
        kvcache_block_size, num_kvcache_blocks), what a request must fit."""
        from nanovllm.llm import LLM

        self.llm = LLM(model, **options)
        config = self.llm.config
        return config.max_model_len, config.kvcache_block_size, self.llm.num_kvcache_blocks

    def generate(self, call_id: int, prompts: list[list[int]], sampling_params: list) -> list:
        """`LLM.generate` of one shard; its progress is `progress()[call_id]` meanwhile."""
        counter = functools.partial(_Counter, self.counts, call_id)
        try:
            return self.llm.generate(prompts, sampling_params, use_tqdm=counter)
        finally:
            self.counts.pop(call_id, None)

    def progress(self) -> dict[int, int]:
        return dict(self.counts)

    def call(self, method: str, args: tuple, kwargs: dict):
        """Run `LLM.<method>(*args, **kwargs)`: the broadcast of DataParallelLLM."""
        if not hasattr(self.llm, method):
            raise AttributeError(f"the engine has no method {method!r}")
        return getattr(self.llm, method)(*args, **kwargs)

    def exit(self):
        if self.llm is not None:
            self.llm.exit()
