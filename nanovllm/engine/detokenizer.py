"""Incremental detokenization of a sequence's output, and its stop strings (as vLLM). The text grows
by whole characters: a split character's bytes wait for its next token (at the end: U+FFFD)."""

from tokenizers.decoders import DecodeStream

from nanovllm.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the output, so that its first token decodes as it would mid-text.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Streaming holds back this many characters: a stop string found later may remove them.
        self.holdback = 0 if self.include_stop or not self.stop else max(map(len, self.stop)) - 1
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        # Leave out a prompt's split last character: its bytes must not join the output's.
        while context and tokenizer.decode(context).endswith("\ufffd"):
            context = context[:-1]
        fast = getattr(tokenizer, "backend_tokenizer", None) is not None
        decoder = StreamDecoder if fast else WindowDecoder
        self.decoder = decoder(tokenizer, context, params.skip_special_tokens)
        self.text = ""
        self.searched = 0
        self.num_output_tokens = 0

    def update(self, token_id: int, finished: bool, stop_terminated: bool) -> str | None:
        """Add one output token; return the stop string it completes, cutting the text there."""
        self.num_output_tokens += 1
        # The text of the EOS or stop id that ended the sequence is left out (as vLLM).
        shown = None if stop_terminated and not self.include_stop else token_id
        self.text += self.decoder.step(shown, finished)
        if self.num_output_tokens <= self.min_tokens:
            self.searched = len(self.text)
            return None
        for stop in self.stop:
            start = self.text.find(stop, max(0, self.searched - len(stop) + 1))
            if start != -1:
                self.text = self.text[:start + len(stop) if self.include_stop else start]
                return stop
        self.searched = len(self.text)
        return None


class StreamDecoder:
    """A fast tokenizer's own incremental decoder (DecodeStream, in Rust): O(1) per token."""

    def __init__(self, tokenizer, context: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in context:
            self.stream.step(self.backend, token_id)
        self.pending: list[int] = []

    def step(self, token_id: int | None, finished: bool) -> str:
        text = ""
        if token_id is not None:
            self.pending.append(token_id)
            chunk = self.stream.step(self.backend, token_id)
            if chunk is not None:
                text, self.pending = chunk, []
        if finished and self.pending:
            skip = self.skip_special_tokens
            text += self.tokenizer.decode(self.pending, skip_special_tokens=skip)
            self.pending = []
        return text


class WindowDecoder:
    """For slow tokenizers: re-decodes the last emitted chunk and the tokens after it each step."""

    def __init__(self, tokenizer, context: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(context)
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.prefix_text = self._decode_from(0)

    def step(self, token_id: int | None, finished: bool) -> str:
        if token_id is not None:
            self.token_ids.append(token_id)
        window = self._decode_from(self.prefix_offset)
        if len(window) <= len(self.prefix_text) or (window.endswith("\ufffd") and not finished):
            return ""
        new = window[len(self.prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.prefix_text = self._decode_from(self.prefix_offset)
        return new

    def _decode_from(self, start: int) -> str:
        tokens = self.token_ids[start:]
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)
