"""Requests in and out: a batch checked before any of it is queued, and the outputs."""

from nanovllm.checkpoint.tokenizer import NoTokenizer
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams, as_token_id


def as_batch(prompts, sampling_params) -> tuple[list, list]:
    """Prompts and sampling params as two lists of equal length (one prompt or params for all)."""
    prompts = _as_list(prompts)
    one_prompt = isinstance(prompts, list) and prompts and as_token_id(prompts[0]) is not None
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
    bad = next((t for t in params.stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"sampling_params[{index}].stop_token_ids has {bad} outside the "
                         f"vocabulary [0, {vocab_size})")


def request_output(seq: Sequence, tokenizer) -> dict:
    """A finished sequence as `generate` returns it."""
    tokens = seq.completion_token_ids
    params = seq.sampling_params
    if seq.detokenizer is not None:
        text = seq.detokenizer.text
    elif isinstance(tokenizer, NoTokenizer):
        text = ""
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


def prompt_output(samples: list[Sequence], tokenizer) -> dict | list[dict]:
    """A prompt's output: its sample's dict, or with n > 1 its n samples' dicts in order."""
    outputs = [request_output(seq, tokenizer) for seq in samples]
    return outputs if samples[0].sampling_params.n > 1 else outputs[0]
