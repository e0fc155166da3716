"""Incremental detokenization of one sequence's output, and stop-string matching on it (as vLLM).

The text grows by whole characters only: a byte-level tokenizer splits é into two tokens, and the
first alone decodes to U+FFFD, so its bytes wait for the next token. When the sequence finishes, an
incomplete tail is flushed as U+FFFD, as a full decode shows it.
"""

from tokenizers.decoders import DecodeStream

from nanovllm.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the output, so its first token decodes as it would mid-text (a
# SentencePiece word-start marker, for instance, only becomes a space after other text).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Streaming holds back this many characters: a stop string found later may remove them.
        self.holdback = 0 if self.include_stop or not self.stop else max(map(len, self.stop)) - 1
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        # A prompt ending inside a character would lend its bytes to the output's first token: leave them out.
        while context and tokenizer.decode(context).endswith("\ufffd"):
            context = context[:-1]
        decoder = StreamDecoder if getattr(tokenizer, "backend_tokenizer", None) is not None else WindowDecoder
        self.decoder = decoder(tokenizer, context, params.skip_special_tokens)
        self.text = ""  # the output so far
        self.searched = 0  # text before this offset holds no stop string, or must not be searched
        self.num_output_tokens = 0

    def update(self, token_id: int, finished: bool, stop_terminated: bool) -> str | None:
        """Add one output token; return the stop string it completes (the text is then cut at it).

        `finished`: the sequence has ended, so an incomplete character at the end is final.
        `stop_terminated`: the token is the EOS or stop id that ended the sequence; vLLM leaves its
        text out unless include_stop_str_in_output.
        """
        self.num_output_tokens += 1
        self.text += self.decoder.step(None if stop_terminated and not self.include_stop else token_id, finished)
        if self.num_output_tokens <= self.min_tokens:  # no stop string within the first min_tokens tokens
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
    """A fast tokenizer's own incremental decoder (tokenizers' DecodeStream, in Rust): O(1) per token."""

    def __init__(self, tokenizer, context: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in context:
            self.stream.step(self.backend, token_id)
        self.pending: list[int] = []  # tokens whose text the stream still holds back

    def step(self, token_id: int | None, finished: bool) -> str:
        """The text `token_id` completes (None: no new token); with `finished`, also the held-back tail."""
        text = ""
        if token_id is not None:
            self.pending.append(token_id)
            chunk = self.stream.step(self.backend, token_id)
            if chunk is not None:
                text, self.pending = chunk, []
        if finished and self.pending:
            text += self.tokenizer.decode(self.pending, skip_special_tokens=self.skip_special_tokens)
            self.pending = []
        return text


class WindowDecoder:
    """For tokenizers without a Rust backend. Each token decodes a short window: the tokens of the
    last emitted chunk (from `prefix_offset`) plus those not emitted yet; the text past the chunk's
    own is new, unless it ends in U+FFFD (a character cut short), in which case the tokens wait."""

    def __init__(self, tokenizer, context: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(context)
        self.prefix_offset = 0  # token_ids[prefix_offset:read_offset]: the last emitted chunk
        self.read_offset = len(self.token_ids)
        self.prefix_text = self._decode_from(0)  # that chunk decoded on its own

    def step(self, token_id: int | None, finished: bool) -> str:
        """The text `token_id` completes (None: no new token); with `finished`, also the held-back tail."""
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
        return self.tokenizer.decode(self.token_ids[start:], skip_special_tokens=self.skip_special_tokens)
