"""The calls RL trainers make between batches: new weights (update_weights), memory freed and
restored (sleep, wake_up), the weights reloaded (collective_rpc). Each is checked on the engine's
state before it acts (`check_ready`), and refused while requests are unfinished. Part of
LLMEngine."""

from nanovllm.checkpoint.loader import (
    check_weights,
    checkpoint_specs,
    checkpoint_tensors,
    weight_pairs,
)

WAKE_TAGS = ("weights", "kv_cache")  # what sleep frees, in the order wake_up restores it


class WeightOps:
    """LLMEngine's weight and memory operations (it holds the state they read and write)."""

    def update_weights(self, weights) -> None:
        """Copy (name, tensor) pairs (checkpoint names, any subset, any device) into the weights in
        place, all checked first; refused while requests are unfinished (README.md)."""
        tied = getattr(self.model_runner.model, "tie_word_embeddings", False)
        pairs = weight_pairs(weights, tied)
        self._load_weights([(name, tuple(t.shape)) for name, t in pairs], pairs)

    def update_weights_from_path(self, path: str) -> None:
        """update_weights with the tensors of `path`/*.safetensors, checked from the headers."""
        self._load_weights(checkpoint_specs(path), checkpoint_tensors(path))

    def _load_weights(self, specs: list[tuple[str, tuple]], weights):
        with self._lock:
            self.check_ready("update_weights", specs)
            self._on_all_ranks("update_weights", specs, local=(weights,))
            self.unloaded_weights -= {name for name, _ in specs}
            self.scheduler.block_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache; level 1 keeps the weights in pinned host memory, level 2 discards
        them (reload them with update_weights() after wake_up())."""
        with self._lock:
            self.check_ready("sleep", level)
            self.scheduler.block_manager.reset_prefix_cache()
            self._on_all_ranks("sleep", level)
            self.sleep_level, self.asleep = level, set(WAKE_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep() freed, or only the `tags` of it ("weights", "kv_cache"); a no-op
        for what is awake."""
        with self._lock:
            self.check_ready("wake_up", tags)
            waking = [tag for tag in WAKE_TAGS if tag in self.asleep and tag in (tags or WAKE_TAGS)]
            if not waking:
                return
            self._on_all_ranks("wake_up", waking)
            if "weights" in waking and self.sleep_level == 2:
                tied = getattr(self.model_runner.model, "tie_word_embeddings", False)
                self.unloaded_weights = set(self.model_runner.weight_shapes) - (
                    {"lm_head.weight"} if tied else set())
            self.asleep -= set(waking)
            if not self.asleep:
                self.sleep_level = 0

    def check_ready(self, method: str, *args):
        """Raise what `method(*args)` (update_weights with its (name, shape) specs, sleep, wake_up)
        would refuse in this state, changing nothing that method would: Ray's replicas all check
        before any of them acts."""
        if method == "sleep" and (args[0] not in (1, 2) or isinstance(args[0], bool)):
            raise ValueError(f"level must be 1 or 2, got {args[0]!r}")
        if method == "wake_up":
            tags = args[0] if args else None
            if tags is not None and (not isinstance(tags, (list, tuple))
                                     or not set(tags) <= set(WAKE_TAGS)):
                raise ValueError(f"tags must be None or a list of {WAKE_TAGS}, got {tags!r}")
        with self._lock:
            self.check_alive(awake=False)
            if method == "wake_up":
                return
            if method == "sleep" and self.asleep:
                raise RuntimeError(f"already asleep (sleep(level={self.sleep_level}))")
            if "weights" in self.asleep:
                raise RuntimeError(f"{method}() while asleep: call wake_up() first")
            self._drain(f"{method}()")
            if method == "update_weights":
                check_weights(self.model_runner.weight_shapes, args[0])

    def _drain(self, action: str):
        """Finish the last step in flight; raise if requests are unfinished."""
        self._apply_aborts()
        if self.inflight is not None and self.scheduler.is_finished():
            self.step()  # a step launched for requests that have all finished since
        unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
        if unfinished:
            raise RuntimeError(f"{action} refused: {unfinished} requests are unfinished; let "
                               "them finish (or close their streams) first")

    def _on_all_ranks(self, method: str, *args, local: tuple = ()):
        """Run a runner method on every rank; on failure the ranks may be out of step: exit."""
        try:
            if self.channel is not None:
                self.channel.send(method, *args)
            getattr(self.model_runner, method)(*args, *local)
        except BaseException:
            self._out_of_step = True
            self.exit()
            raise

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's call on every worker, for what RL trainers call on it: "reload_weights" (the
        checkpoint's tensors again) and "reset_prefix_cache". One result per rank."""
        if method == "reload_weights" and not args and not kwargs:
            self.update_weights_from_path(self.config.model)
        elif method == "reset_prefix_cache" and not args and not kwargs:
            self.reset_prefix_cache()
        else:
            raise NotImplementedError(f"collective_rpc({method!r}) is not supported: the engine "
                                      "runs 'reload_weights' and 'reset_prefix_cache'")
        return [None] * self.config.tensor_parallel_size
