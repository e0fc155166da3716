from collections.abc import Iterator
from dataclasses import dataclass

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import Sequence


@dataclass(slots=True)
class StreamOutput:
    """What one step added to one request of `LLM.stream`."""

    index: int  # the request's position in the prompts given to stream()
    text: str  # new text: never a partial character, nor text a stop string may still remove
    token_ids: list[int]  # new token ids
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


class LLM(LLMEngine):
    """The public entry point: `LLM(model_dir, **options).generate(prompts, sampling_params)`."""

    def chat(self, messages, sampling_params, use_tqdm: bool = True) -> list[dict]:
        """Generate replies to one conversation (a list of {"role": ..., "content": ...} dicts) or to a
        list of them, each rendered by the tokenizer's chat template with the assistant's turn opened."""
        conversations = [messages] if isinstance(messages, list) and messages and isinstance(messages[0], dict) \
            else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise TypeError(f"messages must be a conversation (a list of message dicts) or a non-empty list of "
                            f"them, got {messages!r}")
        for i, conversation in enumerate(conversations):
            if not isinstance(conversation, (list, tuple)) or not conversation or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in conversation):
                raise TypeError(f"conversation {i} must be a non-empty list of {{'role': str, 'content': str}} "
                                f"dicts, got {conversation!r}")
        # Rendered as text, then tokenized without extra special tokens: the template places them (as vLLM).
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(list(c), tokenize=False,
                                                                            add_generation_prompt=True),
                                         add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompts, sampling_params) -> Iterator[StreamOutput]:
        """Like generate, but yield each request's new tokens and text as the steps produce them.

        The batch is validated here, at the call; it is queued when iteration starts. Closing the
        iterator early abandons the unfinished requests and frees their KV blocks."""
        return self._stream(self.make_sequences(prompts, sampling_params, detokenize=True))

    def _stream(self, seqs: list[Sequence]) -> Iterator[StreamOutput]:
        for seq in seqs:
            self.scheduler.add(seq)
        pending = dict(enumerate(seqs))
        sent = {index: (0, 0) for index in pending}  # tokens and characters already yielded
        try:
            while pending:
                self.step()
                for index, seq in list(pending.items()):
                    num_tokens, num_chars = sent[index]
                    if seq.num_output_tokens == num_tokens and not seq.is_finished:
                        continue
                    text = seq.detokenizer.text
                    end = len(text) if seq.is_finished else max(num_chars, len(text) - seq.detokenizer.holdback)
                    sent[index] = (seq.num_output_tokens, end)
                    if seq.is_finished:
                        del pending[index]
                    prompt = seq.num_prompt_tokens  # slice just the new tokens, not the whole output each step
                    new_tokens = seq.token_ids[prompt + num_tokens:prompt + seq.num_output_tokens]
                    yield StreamOutput(index, text[num_chars:end], new_tokens, seq.is_finished, seq.finish_reason,
                                       seq.stop_reason)
        finally:
            for seq in pending.values():
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
