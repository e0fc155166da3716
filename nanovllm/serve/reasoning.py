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
    reasoning, content = ReasoningStream(thinking).feed(text, finished=True)
    return reasoning or None, content


class ReasoningStream:
    """One choice's output as it streams: reasoning passed on until </think>, then content. A
    tail that could begin a tag waits for the next delta; nothing else is kept, so each delta
    costs its own length."""

    def __init__(self, thinking: str):
        # "start": the output may open a block; then "reasoning" until </think>, then "content".
        self.phase = {OPEN: "reasoning", CLOSED: "content", OWN: "start"}[thinking]
        self.held = ""  # text not sent yet: it may be part of a tag

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new content) to send now; with the last delta, all that is left."""
        text, self.held = self.held + text, ""
        reasoning = ""
        if self.phase == "start":
            if THINK.startswith(text) and not finished:
                self.held = text  # maybe the start of <think>
                return "", ""
            self.phase = "reasoning" if text.startswith(THINK) else "content"
            if self.phase == "reasoning":
                text = text[len(THINK):]
        if self.phase == "reasoning":
            end = text.find(END_THINK)
            if end < 0:
                keep = 0 if finished else held_tail(text, END_THINK)
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            reasoning, text = text[:end], text[end + len(END_THINK):]
            self.phase = "content"
        return reasoning, text
