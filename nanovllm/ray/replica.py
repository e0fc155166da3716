"""EngineReplica: one engine inside a Ray actor, driven by DataParallelEngine (data_parallel.py)."""

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.requests import Request
from nanovllm.extras import import_extra


def import_ray(what: str):
    return import_extra("ray", "ray", f"{what} needs Ray, which is not installed")


class EngineReplica:
    """A Ray actor holding one `LLMEngine`; threaded, so that concurrent shards share its steps and
    an abort reaches a shard that is running."""

    def __init__(self):
        self.engine: LLMEngine | None = None

    def start(self, model: str, options: dict):
        """Build the engine (errors come back as themselves); returns its RequestLimits and its
        tokenizer, which the driver checks requests with."""
        self.engine = LLMEngine(model, **options)
        return self.engine.limits, self.engine.tokenizer

    def generate(self, requests: list[Request]):
        """Stream a shard of checked requests: (index in the shard, output) as each completes."""
        # A loop, not `yield from`: Ray resumes the generator with send(), which `yield from`
        # would pass down to the list iterators inside as_completed.
        for completed in self.engine.as_completed(requests):  # noqa: UP028
            yield completed

    def abort(self, request_ids: list[str]):
        """Finish these requests ("abort"): a shard holding them completes them at once."""
        self.engine.abort_requests(request_ids)

    def call(self, method: str, args: tuple, kwargs: dict):
        """Run `LLMEngine.<method>(*args, **kwargs)`: the broadcast of DataParallelEngine."""
        if not hasattr(self.engine, method):
            raise AttributeError(f"the engine has no method {method!r}")
        return getattr(self.engine, method)(*args, **kwargs)

    def exit(self):
        if self.engine is not None:
            self.engine.exit()
