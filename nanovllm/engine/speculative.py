"""N-gram speculation (prompt lookup): a sequence's next tokens guessed by copying what followed
the last time its latest tokens occurred, in its prompt or its output. The engine verifies a
draft of d tokens in one decode step of 1 + d rows (scheduler.scheduled_step) and keeps the
longest prefix the target model samples too, plus the model's own next token."""

from nanovllm.config import SpeculativeConfig

# Occurrences of the latest prompt_lookup_min tokens examined per proposal, most recent first.
MAX_CANDIDATES = 8
# After a draft with no token accepted, a sequence skips this many chances to draft, doubling
# with each further miss up to MAX_BACKOFF; an accepted token resets it.
FIRST_BACKOFF, MAX_BACKOFF = 1, 64
# A sequence's expected accepted tokens a draft (DraftGate): before its first verified draft, and
# the weight of each new outcome in the moving average.
FIRST_EXPECTED, EXPECTED_WEIGHT = 1.0, 0.5
# DraftGate: a step verifies drafts when they are expected to add this many tokens a running
# sequence (docs/architecture.md, "The gate"), and at least every PROBE_STEPS declined steps.
MIN_GAIN_PER_SEQUENCE, PROBE_STEPS = 1.0, 64


class NgramDrafter:
    """One sequence's index of where each prompt_lookup_min-gram occurred and its drafting state.
    `starts[gram]`: the positions right after each occurrence of `gram`, in increasing order."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.starts: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # grams ending before this position are indexed
        self.skip = 0  # chances to draft left to skip
        self.backoff = FIRST_BACKOFF
        self.expected = FIRST_EXPECTED  # moving average of the tokens a draft had accepted

    def propose(self, tokens: list[int], num_known: int) -> list[int]:
        """Up to k tokens to follow tokens[:num_known]; [] when nothing matches or backing off."""
        self._index(tokens, num_known)
        if self.skip:
            self.skip -= 1
            return []
        if num_known <= self.min_n:
            return []
        suffix_end = num_known
        candidates = self.starts.get(tuple(tokens[suffix_end - self.min_n:suffix_end]), ())
        best, best_len = -1, 0
        for start in reversed(candidates[-MAX_CANDIDATES:]):
            length = self.min_n
            while (length < self.max_n and start - length > 0
                   and tokens[start - length - 1] == tokens[suffix_end - length - 1]):
                length += 1
            if length > best_len:
                best, best_len = start, length
                if length == self.max_n:
                    break
        if best < 0:
            return []
        return tokens[best:min(best + self.k, num_known)]

    def record(self, num_drafted: int, num_accepted: int):
        """A verified draft's outcome: no token accepted backs drafting off."""
        if not num_drafted:
            return
        self.expected += EXPECTED_WEIGHT * (num_accepted - self.expected)
        if num_accepted:
            self.backoff = FIRST_BACKOFF
        else:
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF)

    def _index(self, tokens: list[int], num_known: int):
        """Index the grams that end before the last known token (each has a known successor)."""
        n = self.min_n
        for end in range(max(self.indexed, n), num_known):
            self.starts.setdefault(tuple(tokens[end - n:end]), []).append(end)
        self.indexed = max(self.indexed, num_known)


class DraftGate:
    """Whether the next decode step verifies the drafts proposed for it. A step with drafts cannot
    overlap the host's work for it with the GPU's work of the step before, which costs up to a
    plain step's time: it pays when its drafts are expected to add at least
    MIN_GAIN_PER_SEQUENCE tokens a running sequence. Declined steps keep the estimates they had,
    so every PROBE_STEPS-th declined step verifies anyway and they are measured again."""

    def __init__(self):
        self.declined = 0  # steps declined since the last verified one

    def admits(self, drafters: list[NgramDrafter], num_running: int) -> bool:
        """drafters: those of the sequences with a draft for the next step."""
        expected = sum(drafter.expected for drafter in drafters)
        if expected >= MIN_GAIN_PER_SEQUENCE * num_running or self.declined + 1 >= PROBE_STEPS:
            self.declined = 0
            return True
        self.declined += 1
        return False


def accepted_length(draft: list[int], sampled: list[int]) -> int:
    """How many leading draft tokens the target sampled too: sampled[i] is the target's token
    after draft[:i], so the step yields sampled[:accepted + 1]."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == sampled[accepted]:
        accepted += 1
    return accepted
