"""A thinking model's reasoning, apart from its answer (`--reasoning-parser qwen3`, as vLLM): the
text of a <think> ... </think> block goes to the message's `reasoning`, the rest to `content`.
Where the prompt ends says where the output starts (prompt_thinking): a chat template may open
the block (Qwen3's thinking templates: the output starts in it), close it empty (Qwen3's
enable_thinking=False: all the output is content), or leave it to the model (Qwen3's own
template: the output opens it with <think>, or is all content)."""

THINK, END_THINK = "<think>", "</think>"
REASONING_PARSERS = ("qwen3",)
OPEN, CLOSED, OWN = "open", "closed", "own"  # prompt_thinking's answers


def held_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`: they wait for more text."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def prompt_thinking(prompt: str) -> str:
    """OPEN if the rendered prompt ends in an open think block, CLOSED if in a closed one, else
    OWN (the output may open its own)."""
    end = prompt.rstrip()
    return OPEN if end.endswith(THINK) else CLOSED if end.endswith(END_THINK) else OWN


def split_reasoning(text: str, thinking: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole output; `thinking`: prompt_thinking's answer. Cut short
    before </think>, it is all reasoning."""
    if thinking == CLOSED:
        return None, text
    if thinking == OWN:
        if not text.startswith(THINK):
            return None, text
        text = text[len(THINK):]
    reasoning, _, content = text.partition(END_THINK)
    return reasoning or None, content


class ReasoningStream:
    """One choice's output as it streams: reasoning passed on until </think> (a tail that could
    begin a tag waits), then content. What it sends joins up to split_reasoning's answer."""

    def __init__(self, thinking: str):
        self.thinking = thinking
        self.text = ""
        self.sent = [0, 0]  # characters of reasoning and of content sent

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new content) to send now."""
        self.text += text
        reasoning, content = self._visible() if not finished else split_reasoning(
            self.text, self.thinking)
        reasoning = reasoning or ""
        new = reasoning[self.sent[0]:], content[self.sent[1]:]
        self.sent = [len(reasoning), len(content)]
        return new

    def _visible(self) -> tuple[str, str]:
        """What of the reasoning and the content is certain so far."""
        text = self.text
        if self.thinking == CLOSED:
            return "", text
        if self.thinking == OWN:
            if THINK.startswith(text):
                return "", ""  # maybe the start of <think>
            if not text.startswith(THINK):
                return "", text
            text = text[len(THINK):]
        end = text.find(END_THINK)
        if end >= 0:
            return text[:end], text[end + len(END_THINK):]
        return text[:len(text) - held_tail(text, END_THINK)], ""
