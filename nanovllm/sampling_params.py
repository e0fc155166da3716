"""Per-request sampling settings, named as in vLLM."""

from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise TypeError(f"temperature must be a float, got {self.temperature!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise TypeError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
