from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import accumulate

import torch

from nanovllm.checkpoint.loader import check_weights, checkpoint_specs, checkpoint_tensors
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import Sequence


@dataclass(slots=True)
class StreamOutput:
    """What one step added to the request of `LLM.stream` at position `index` of its prompts."""

    index: int
    text: str  # new text: never a partial character, nor text a stop string may still remove
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sample: int = 0  # which of the prompt's SamplingParams.n completions


def _is_conversation(messages) -> bool:
    return isinstance(messages, (list, tuple)) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)


def conversation_prompts(tokenizer, messages) -> list[list[int]]:
    """One conversation (a list of {"role", "content"} dicts) or a list of them, rendered by the
    chat template with the assistant's turn opened, as token ids."""
    is_one = isinstance(messages, list) and messages and isinstance(messages[0], dict)
    conversations = [messages] if is_one else messages
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise TypeError("messages must be a conversation (a list of message dicts) or a "
                        f"non-empty list of them, got {messages!r}")
    for i, conversation in enumerate(conversations):
        if not _is_conversation(conversation):
            raise TypeError(f"conversation {i} must be a non-empty list of "
                            f"{{'role': str, 'content': str}} dicts, got {conversation!r}")
    # The chat template places the special tokens, so encoding adds none (as vLLM).
    return [tokenizer.encode(
        tokenizer.apply_chat_template(list(c), tokenize=False, add_generation_prompt=True),
        add_special_tokens=False) for c in conversations]


class LLM(LLMEngine):
    """`LLM(model, **options).generate(prompts, sampling_params)`; a DataParallelLLM on Ray."""

    def __new__(cls, *args, **options):
        from nanovllm.ray.data_parallel import uses_ray

        if uses_ray(options):
            from nanovllm.ray.data_parallel import DataParallelLLM

            return DataParallelLLM(*args, **options)
        return super().__new__(cls)

    def __init__(self, model: str, **options):
        for name in ("data_parallel_size", "data_parallel_backend"):
            options.pop(name, None)  # checked by uses_ray: one in-process engine
        super().__init__(model, **options)

    def chat(self, messages, sampling_params, use_tqdm: bool = True) -> list:
        """Reply to one conversation (a list of {"role", "content"} dicts) or a list of them."""
        prompts = conversation_prompts(self.tokenizer, messages)
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompts, sampling_params) -> Iterator[StreamOutput]:
        """Like generate (validated now, queued on iteration), yielding each step's new output."""
        return self._stream(self.make_sequences(prompts, sampling_params, detokenize=True))

    def _stream(self, seqs: list[Sequence]) -> Iterator[StreamOutput]:
        self._add(seqs)
        pending = dict(enumerate(seqs))  # flat: the samples of a prompt follow one another
        sent = {index: (0, 0) for index in pending}  # tokens and characters already yielded
        prompt_of = list(accumulate(seq.sample_index == 0 for seq in seqs))
        try:
            while pending:
                with self._lock:  # another caller's steps may have advanced these requests
                    outputs = _new_outputs(pending, sent, prompt_of)
                    if not outputs:
                        self.step()
                        outputs = _new_outputs(pending, sent, prompt_of)
                yield from outputs
        finally:
            self._abort(list(pending.values()))


    def update_weights(self, weights) -> None:
        """Copy (name, tensor) pairs (checkpoint names, any subset, any device) into the weights in
        place, all checked first; refused while requests are unfinished (README.md)."""
        pairs = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                    and isinstance(pair[1], torch.Tensor)):
                raise TypeError(f"weights[{i}] must be a (name, tensor) pair, got "
                                f"{type(pair).__name__}")
        self._load_weights([(name, tuple(t.shape)) for name, t in pairs], pairs)

    def update_weights_from_path(self, path: str) -> None:
        """update_weights with the tensors of `path`/*.safetensors, checked from the headers."""
        self._load_weights(checkpoint_specs(path), checkpoint_tensors(path))

    def _load_weights(self, specs: list[tuple[str, tuple]], weights):
        with self._lock:
            self._check_alive(awake=False)
            if self.sleep_level:
                raise RuntimeError("update_weights() while asleep: call wake_up() first")
            self._drain("update_weights()")
            check_weights(self.model_runner.weight_shapes, specs)
            self._on_all_ranks("update_weights", specs, local=(weights,))
            self.unloaded_weights -= {name for name, _ in specs}
            self.scheduler.block_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache; level 1 keeps the weights in pinned host memory, level 2 discards
        them (reload them with update_weights() after wake_up())."""
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        with self._lock:
            self._check_alive(awake=False)
            if self.sleep_level:
                raise RuntimeError(f"already asleep (sleep(level={self.sleep_level}))")
            self._drain("sleep()")
            self.scheduler.block_manager.reset_prefix_cache()
            self._on_all_ranks("sleep", level)
            self.sleep_level = level

    def wake_up(self) -> None:
        """Restore what sleep() freed (a no-op when awake)."""
        with self._lock:
            self._check_alive(awake=False)
            if not self.sleep_level:
                return
            self._on_all_ranks("wake_up")
            if self.sleep_level == 2:
                tied = getattr(self.model_runner.model, "tie_word_embeddings", False)
                self.unloaded_weights = set(self.model_runner.weight_shapes) - (
                    {"lm_head.weight"} if tied else set())
            self.sleep_level = 0

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

def _new_outputs(pending: dict[int, Sequence], sent: dict[int, tuple[int, int]],
                 prompt_of: list[int]) -> list[StreamOutput]:
    """What the pending requests produced since `sent`; drops the finished ones from `pending`."""
    outputs = []
    for index, seq in list(pending.items()):
        num_tokens, num_chars = sent[index]
        if seq.num_output_tokens == num_tokens and not seq.is_finished:
            continue
        text, holdback = seq.detokenizer.text, seq.detokenizer.holdback
        end = len(text) if seq.is_finished else max(num_chars, len(text) - holdback)
        sent[index] = (seq.num_output_tokens, end)
        if seq.is_finished:
            del pending[index]
        start = seq.num_prompt_tokens + num_tokens
        new_tokens = seq.token_ids[start:seq.num_prompt_tokens + seq.num_output_tokens]
        outputs.append(StreamOutput(prompt_of[index] - 1, text[num_chars:end], new_tokens,
                                    seq.is_finished, seq.finish_reason, seq.stop_reason,
                                    seq.sample_index))
    return outputs
