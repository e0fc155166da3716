"""Requests in and out: a batch checked before any of it is queued, EOS ids, and the outputs."""

import json
import os

from nanovllm.config import Config
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def as_batch(prompts, sampling_params) -> tuple[list, list]:
    """Prompts and sampling params as two lists of equal length (one prompt or params for all)."""
    one_prompt = isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    if isinstance(prompts, str) or one_prompt:
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a list of str, or a list of token-id lists, got "
                        f"{type(prompts).__name__}")
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    elif not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                        f"{type(sampling_params).__name__}")
    if len(sampling_params) != len(prompts):
        raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
    kinds = {type(p) for p in prompts}
    if not (kinds <= {str} or kinds <= {list, tuple}):
        raise TypeError(f"prompts must be all str or all token-id lists, got a mix of "
                        f"{sorted(k.__name__ for k in kinds)}")
    return list(prompts), list(sampling_params)


def check_request(index: int, tokens: list, params, vocab_size: int):
    """Raise for what the engine cannot take in request `index` of a batch."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params[{index}] is a {type(params).__name__}, "
                        "not SamplingParams")
    if not tokens:
        raise ValueError(f"prompt {index} is empty")
    bad = next((t for t in tokens if not isinstance(t, int) or isinstance(t, bool)
                or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt {index} has token id {bad!r} outside the vocabulary "
                         f"[0, {vocab_size})")
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"sampling_params[{index}].stop_token_ids has {bad} outside the "
                         f"vocabulary [0, {vocab_size})")


def eos_token_ids(tokenizer, config: Config) -> set[int]:
    """EOS ids from the tokenizer, config.json and generation_config.json, whichever define them."""
    ids = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(tokenizer.eos_token_id)
    add(getattr(config.hf_config, "eos_token_id", None))
    path = os.path.join(config.model, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            add(json.load(f).get("eos_token_id"))
    return ids


def request_output(seq: Sequence, tokenizer) -> dict:
    """A finished sequence as `generate` returns it."""
    tokens = seq.completion_token_ids
    params = seq.sampling_params
    if seq.detokenizer is not None:
        text = seq.detokenizer.text
    else:  # as vLLM, without the text of the EOS or stop id that ended the sequence
        hide_stop = seq.finish_reason == "stop" and not params.include_stop_str_in_output
        shown = tokens[:-1] if hide_stop else tokens
        text = tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
    output = {"text": text, "token_ids": tokens, "finish_reason": seq.finish_reason,
              "stop_reason": seq.stop_reason}
    if params.logprobs is not None:
        output["logprobs"] = seq.logprobs
        output["cumulative_logprob"] = seq.cumulative_logprob
    return output
