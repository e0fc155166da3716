from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate

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


class LLM(LLMEngine):
    """The public entry point: `LLM(model_dir, **options).generate(prompts, sampling_params)`."""

    def chat(self, messages, sampling_params, use_tqdm: bool = True) -> list:
        """Reply to one conversation (a list of {"role", "content"} dicts) or a list of them."""
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
        prompts = [self.tokenizer.encode(
            self.tokenizer.apply_chat_template(list(c), tokenize=False, add_generation_prompt=True),
            add_special_tokens=False) for c in conversations]
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
