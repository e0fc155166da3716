"""Requests in: a batch tokenized and checked against the engine's limits before any of it is
queued. The one validation path, for the local engine and the Ray replicas alike."""

from collections.abc import Iterator
from dataclasses import dataclass

from nanovllm.checkpoint.tokenizer import NoTokenizer
from nanovllm.engine.scheduler import check_fits
from nanovllm.sampling_params import SamplingParams, as_token_id


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request must fit: the vocabulary, the context, the KV pool and the batch."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_logprobs: int = 20

    def check_fits(self, num_prompt_tokens: int, max_tokens: int, n: int):
        """Raise ValueError if a request of this size (n samples) could never be scheduled."""
        if n > self.max_num_seqs:
            raise ValueError(f"n={n} samples exceed max_num_seqs={self.max_num_seqs}")
        check_fits(num_prompt_tokens, max_tokens, self.max_model_len, self.block_size,
                   self.num_blocks, n)


@dataclass(slots=True)
class Request:
    """A checked request: its prompt as token ids and its sampling settings."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the prompt's text, if it was given as text
    banned_token_ids: tuple[int, ...] = ()  # params.bad_words as token ids
    # params.structured_outputs compiled (engine.grammar.Grammars), or as grammar.serialize's JSON
    grammar: object = None


def make_requests(prompts, sampling_params, tokenizer, limits: RequestLimits,
                  request_ids: Iterator[int], stream: bool = False,
                  grammars=None) -> list[Request]:
    """Tokenize and check a whole batch (one prompt or params may stand for all); raises before
    anything is queued, naming the prompt, the value and the limit. stream: text as it comes.
    grammars: the engine's Grammars, which compiles structured outputs here, in the caller's
    thread (None: the engine takes none)."""
    prompts, sampling_params = as_batch(prompts, sampling_params)
    requests = []
    for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
        text, tokens = prompt_tokens(i, prompt, tokenizer)
        check_request(i, tokens, params, limits.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > limits.max_logprobs:
                raise ValueError(f"sampling_params[{i}].{name}={getattr(params, name)} exceeds "
                                 f"the engine's max_logprobs={limits.max_logprobs}")
        if (stream or params.stop) and isinstance(tokenizer, NoTokenizer):
            tokenizer.decode(tokens)  # refuses: stop strings and streamed text need a tokenizer
        if params.truncate_prompt_tokens is not None:  # as vLLM: the last k tokens
            keep = params.truncate_prompt_tokens
            tokens = tokens[-(limits.max_model_len if keep == -1 else keep):]
        try:
            limits.check_fits(len(tokens), params.max_tokens, params.n)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        banned = bad_word_ids(i, params.bad_words, tokenizer) if params.bad_words else ()
        grammar = compile_grammar(i, params, grammars)
        requests.append(Request(str(next(request_ids)), tokens, params, text, banned, grammar))
    return requests


def compile_grammar(index: int, params: SamplingParams, grammars):
    """params.structured_outputs compiled (cached by the engine), or None without it."""
    if params.structured_outputs is None:
        return None
    if grammars is None:
        raise ValueError(f"sampling_params[{index}].structured_outputs: this engine does not "
                         "support structured outputs (data_parallel_size > 1)")
    try:
        return grammars.compile(params.structured_outputs)
    except ValueError as e:
        raise ValueError(f"sampling_params[{index}]: {e}") from None


def bad_word_ids(index: int, words: list[str], tokenizer) -> tuple[int, ...]:
    """The ids that spell each bad word as one token, as it stands and after a space (vLLM's two
    spellings). A word that is one token in neither spelling raises: its tokens would have to be
    banned only after the ones before them, which the overlapped steps cannot see in time."""
    ids = set()
    for word in words:
        spellings = [tokenizer.encode(text, add_special_tokens=False)
                     for text in (word, " " + word.lstrip())]
        single = [tokens[0] for tokens in spellings if len(tokens) == 1]
        if not single:
            raise ValueError(f"sampling_params[{index}].bad_words has {word!r}, which is "
                             f"{min(map(len, spellings))} tokens: only words of one token "
                             "(with or without a leading space) are supported")
        ids.update(single)
    return tuple(sorted(ids))


def as_batch(prompts, sampling_params) -> tuple[list, list]:
    """Prompts and sampling params as two lists of equal length (one prompt or params for all;
    no params: the defaults)."""
    prompts = _as_list(prompts)
    one_prompt = isinstance(prompts, list) and prompts and as_token_id(prompts[0]) is not None
    if isinstance(prompts, (str, dict)) or one_prompt:
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a token-id list, a {{'prompt': ...}} or "
                        f"{{'prompt_token_ids': ...}} dict, or a list of them, got "
                        f"{type(prompts).__name__}")
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    elif not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}")
    if len(sampling_params) != len(prompts):
        raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
    return list(prompts), list(sampling_params)


def prompt_tokens(index: int, prompt, tokenizer) -> tuple[str | None, list]:
    """(the prompt's text if it has one, its token ids): from a str, a token-id list, a
    TextPrompt {"prompt": str} or a TokensPrompt {"prompt_token_ids": [...]}."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(f"prompt {index} has {', '.join(sorted(map(repr, unknown)))}: only "
                             "'prompt' and 'prompt_token_ids' are supported (text-only models)")
        if "prompt_token_ids" in prompt:
            ids = _as_list(prompt["prompt_token_ids"])
            if not isinstance(ids, (list, tuple)):
                raise TypeError(f"prompt {index}: prompt_token_ids must be a list of int, got "
                                f"{type(ids).__name__}")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], tokenizer.encode(prompt["prompt"])
        raise TypeError(f"prompt {index} must hold 'prompt' (a str) or 'prompt_token_ids', got "
                        f"{prompt!r}")
    raise TypeError(f"prompt {index} must be a str, a token-id list or a prompt dict, got "
                    f"{type(prompt).__name__}")


def _as_list(prompts):
    """A numpy array (or tensor) of token ids as lists: 1-D is one prompt, 2-D a batch."""
    if getattr(prompts, "ndim", None) in (1, 2) and hasattr(prompts, "tolist"):
        return prompts.tolist()
    if isinstance(prompts, (list, tuple)) and prompts and getattr(prompts[0], "ndim", 0) == 1:
        return [p.tolist() if getattr(p, "ndim", None) == 1 else p for p in prompts]
    return prompts


def check_request(index: int, tokens: list, params, vocab_size: int):
    """Raise for what the engine cannot take in request `index` of a batch."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params[{index}] is a {type(params).__name__}, "
                        "not SamplingParams")
    params.verify()
    if not tokens:
        raise ValueError(f"prompt {index} is empty")
    for i, token in enumerate(tokens):
        if type(token) is not int:  # numpy's ints become ints, in place
            tokens[i] = as_token_id(token)
            if tokens[i] is None:
                raise ValueError(f"prompt {index} has token id {token!r}, which is not an int")
        if not 0 <= tokens[i] < vocab_size:
            raise ValueError(f"prompt {index} has token id {tokens[i]} outside the vocabulary "
                             f"[0, {vocab_size})")
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        bad = next((t for t in getattr(params, name) or () if t >= vocab_size), None)
        if bad is not None:
            raise ValueError(f"sampling_params[{index}].{name} has {bad} outside the "
                             f"vocabulary [0, {vocab_size})")
