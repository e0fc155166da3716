"""Per-request sampling settings, named and defined as in vLLM."""

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

MAX_LOGPROBS = 20
# The constraint fields of StructuredOutputsParams: exactly one is set (vLLM's rule).
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """A grammar the output must follow, as vLLM names it: a JSON schema (a dict or its JSON
    text), a regex, one of `choice`, an EBNF `grammar`, or any JSON object (`json_object`)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without optional whitespace between tokens
    disable_additional_properties: bool = False  # objects may hold only the schema's properties
    whitespace_pattern: str | None = None  # not supported (xgrammar has no such option)
    structural_tag: str | None = None  # not supported

    def __post_init__(self):
        self.verify()

    def verify(self):
        """vLLM's one-of rule, and the options this engine does not support."""
        count = sum(getattr(self, name) not in (None, False) for name in CONSTRAINTS)
        if count > 1:
            raise ValueError("You can only use one kind of structured outputs constraint but "
                             f"multiple are specified: {self._constraints()}")
        if count < 1:
            raise ValueError("You must use one kind of structured outputs constraint but none "
                             f"are specified: {self._constraints()}")
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"structured_outputs.{name} is not supported")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of str, got "
                             f"{self.choice!r}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"structured_outputs.{name} must be a str, got "
                                f"{getattr(self, name)!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(f"structured_outputs.json must be a JSON schema (a dict or its JSON "
                            f"text), got {type(self.json).__name__}")

    def _constraints(self) -> dict:
        return {name: getattr(self, name) for name in CONSTRAINTS}



@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # completions of the prompt: one prefill, n samples sharing its KV blocks
    temperature: float = 1.0
    top_p: float = 1.0  # the smallest set of tokens whose probability reaches top_p; 1 = off
    top_k: int = 0  # the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the top token; 0 = off
    seed: int | None = None  # draws keyed by (seed, token position): the same in any batch
    max_tokens: int = 64
    min_tokens: int = 0  # EOS and stop_token_ids cannot end generation before this many tokens
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or the output
    # subtracted from the logits of output tokens: once (presence), per occurrence (frequency)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # the top-N log-probabilities (plus the sampled token's)
    prompt_logprobs: int | None = None  # the same for every prompt token but the first
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # fast tokenizers place these spaces themselves
    detokenize: bool = True  # False: token ids only, text ""
    best_of: int | None = None  # vLLM's name for n; another value is not supported
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    allowed_token_ids: list[int] | None = None  # sample only among these
    logit_bias: dict[int, float] | None = None  # added to the logits of these tokens
    bad_words: list[str] | None = None  # words never generated
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output follows

    def __post_init__(self):
        self.verify()

    def verify(self):
        """Check every field, again after edits; `stop` and `stop_token_ids` become lists."""
        _check_int("n", self.n, lambda v: v >= 1, ">= 1")
        _check_float("temperature", self.temperature, lambda v: v >= 0, ">= 0 (0 = greedy)")
        _check_float("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check_int("top_k", self.top_k, lambda v: v >= -1, "0 or -1 (off) or >= 1")
        _check_float("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed, lambda v: 0 <= v < 2**64, "in [0, 2**64)")
        _check_int("max_tokens", self.max_tokens, lambda v: v >= 1, ">= 1")
        _check_int("min_tokens", self.min_tokens, lambda v: 0 <= v <= self.max_tokens,
                   f"in [0, max_tokens={self.max_tokens}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.stop = _string_list(self.stop)
        self.stop_token_ids = _id_list(self.stop_token_ids)
        _check_float("repetition_penalty", self.repetition_penalty, lambda v: v > 0,
                     "> 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), lambda v: -2 <= v <= 2, "in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), lambda v: 0 <= v <= MAX_LOGPROBS,
                           f"in [0, {MAX_LOGPROBS}]")
        for name in ("spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.best_of is not None:
            _check_int("best_of", self.best_of, lambda v: v == self.n,
                       f"equal to n={self.n} (more candidates than samples is not supported)")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens,
                       lambda v: v >= 1 or v == -1, ">= 1, or -1 for max_model_len")
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings {self.stop!r} need detokenize=True")
        self._verify_token_controls()

    def _verify_token_controls(self):
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _id_list(self.allowed_token_ids, "allowed_token_ids")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> float, got "
                                f"{self.logit_bias!r}")
            ids = _id_list(list(self.logit_bias), "logit_bias")
            for token_id, bias in zip(ids, self.logit_bias.values()):
                _check_float(f"logit_bias[{token_id}]", bias, lambda v: -100 <= v <= 100,
                             "in [-100, 100]")
            self.logit_bias = {token_id: float(bias)
                               for token_id, bias in zip(ids, self.logit_bias.values())}
        if self.bad_words is not None:
            self.bad_words = _string_list(self.bad_words, "bad_words")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError(f"structured_outputs must be a StructuredOutputsParams, got "
                                f"{type(self.structured_outputs).__name__}")
            self.structured_outputs.verify()

    @property
    def uses_only_temperature(self) -> bool:
        return (self.top_k in (0, -1) and self.top_p == 1 and self.min_p == 0 and self.seed is None
                and self.logprobs is None and not self.uses_penalties and not self.logit_bias
                and not self.allowed_token_ids and not self.bad_words)

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


def _check_float(name: str, value, in_range: Callable[[float], bool], allowed: str):
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a float, got {value!r}")
    if not (math.isfinite(value) and in_range(value)):
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value, in_range: Callable[[int], bool], allowed: str):
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not in_range(value):
        raise ValueError(f"{name} must be {allowed}, got {value}")


def _string_list(strings, name: str = "stop") -> list[str]:
    if strings is None:
        return []
    if isinstance(strings, str):
        strings = [strings]
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise TypeError(f"{name} must be a str or a list of str, got {strings!r}")
    if not all(strings):
        raise ValueError(f"{name} strings must be non-empty, got {strings!r}")
    return list(strings)


def as_token_id(value) -> int | None:
    """`value` as an int if it is an integer (numpy's too) and not a bool, else None."""
    if type(value) is int:
        return value
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _id_list(ids, name: str = "stop_token_ids") -> list[int]:
    if ids is None:
        return []
    as_ints = [as_token_id(i) for i in ids] if isinstance(ids, (list, tuple)) else [None]
    if None in as_ints:
        raise TypeError(f"{name} must be a list of int, got {ids!r}")
    if any(i < 0 for i in as_ints):
        raise ValueError(f"{name} must be >= 0, got {ids!r}")
    return as_ints
