from collections.abc import Iterator
from dataclasses import dataclass

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
    """The public entry point: `LLM(model_dir, **options).generate(prompts, sampling_params)`.

    With `data_parallel_size > 1` (or `data_parallel_backend="ray"`) it returns a
    `DataParallelLLM`: replicas of the engine as Ray actors (nanovllm/data_parallel.py)."""

    def __new__(cls, *args, **options):
        from nanovllm.data_parallel import uses_ray

        if uses_ray(options):
            from nanovllm.data_parallel import DataParallelLLM

            return DataParallelLLM(*args, **options)
        return super().__new__(cls)

    def __init__(self, model: str, **options):
        for name in ("data_parallel_size", "data_parallel_backend"):
            options.pop(name, None)  # checked by uses_ray: one in-process engine
        super().__init__(model, **options)

    def chat(self, messages, sampling_params, use_tqdm: bool = True) -> list[dict]:
        """Reply to one conversation (a list of {"role", "content"} dicts) or a list of them."""
        prompts = conversation_prompts(self.tokenizer, messages)
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompts, sampling_params) -> Iterator[StreamOutput]:
        """Like generate (validated now, queued on iteration), yielding each step's new output."""
        return self._stream(self.make_sequences(prompts, sampling_params, detokenize=True))

    def _stream(self, seqs: list[Sequence]) -> Iterator[StreamOutput]:
        self._add(seqs)
        pending = dict(enumerate(seqs))
        sent = {index: (0, 0) for index in pending}  # tokens and characters already yielded
        try:
            while pending:
                with self._lock:  # another caller's steps may have advanced these requests
                    outputs = _new_outputs(pending, sent)
                    if not outputs:
                        self.step()
                        outputs = _new_outputs(pending, sent)
                yield from outputs
        finally:
            self._abort(list(pending.values()))


def _new_outputs(pending: dict[int, Sequence], sent: dict[int, tuple[int, int]]
                 ) -> list[StreamOutput]:
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
        outputs.append(StreamOutput(index, text[num_chars:end], new_tokens, seq.is_finished,
                                    seq.finish_reason, seq.stop_reason))
    return outputs
