"""Requests out: the one place a finished request's output, or a stream's next piece, is built
from its sequences."""

from dataclasses import dataclass

from nanovllm.checkpoint.tokenizer import NoTokenizer
from nanovllm.engine.requests import Request
from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass(slots=True)
class StreamOutput:
    """What one step added to the request of `LLM.stream` at position `index` of its prompts."""

    index: int
    text: str  # new text: never a partial character, nor text a stop string may still remove
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sample: int = 0  # which of the prompt's SamplingParams.n completions


def completion_output(seq: Sequence, tokenizer) -> CompletionOutput:
    """A finished sample as a CompletionOutput."""
    tokens = seq.completion_token_ids
    params = seq.sampling_params
    if seq.detokenizer is not None:
        text = seq.detokenizer.text
    elif isinstance(tokenizer, NoTokenizer) or not params.detokenize:
        text = ""
    else:  # as vLLM, without the text of the EOS or stop id that ended the sequence
        hide_stop = seq.finish_reason == "stop" and not params.include_stop_str_in_output
        shown = tokens[:-1] if hide_stop else tokens
        text = tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
    logprobs = cumulative = None
    if params.logprobs is not None:
        decode = _decoder(tokenizer, params)
        logprobs = [as_logprobs(step, rank, params.logprobs, decode)
                    for step, rank in zip(seq.logprobs, seq.logprob_ranks)]
        cumulative = seq.cumulative_logprob
    return CompletionOutput(seq.sample_index, text, tokens, cumulative, logprobs,
                            seq.finish_reason, seq.stop_reason)


def as_logprobs(step: dict[int, float], sampled_rank: int, num_top: int,
                decode) -> dict[int, Logprob]:
    """A step's {token id: logprob} (the sampled id first, then the top `num_top` by rank, the
    sampled one left where it stood first) as Logprobs with their ranks and text."""
    sampled, *others = step
    if len(others) < num_top:  # it was one of the top: put it back in its place
        others.insert(min(sampled_rank, num_top) - 1, sampled)
    ranks = {token_id: rank for rank, token_id in enumerate(others, 1)}
    ranks[sampled] = sampled_rank
    return {token_id: Logprob(logprob, ranks[token_id],
                              None if decode is None else decode([token_id]))
            for token_id, logprob in step.items()}


def request_output(request: Request, samples: list[Sequence], tokenizer) -> RequestOutput:
    """A prompt's output once its n samples have finished (the first computed its prompt)."""
    first = samples[0]
    params = first.sampling_params
    prompt_logprobs = None
    if params.prompt_logprobs is not None:
        decode = _decoder(tokenizer, params)
        prompt_logprobs = [None] + [
            as_logprobs(step, rank, params.prompt_logprobs, decode)
            for step, rank in zip(first.prompt_logprobs, first.prompt_logprob_ranks)]
    return RequestOutput(request.request_id, request.prompt,
                         first.token_ids[:first.num_prompt_tokens], prompt_logprobs,
                         [completion_output(seq, tokenizer) for seq in samples], finished=True,
                         num_cached_tokens=first.num_prefix_hit_tokens or 0)


def _decoder(tokenizer, params):
    """tokenizer.decode for Logprob.decoded_token, or None without a tokenizer or detokenize."""
    if isinstance(tokenizer, NoTokenizer) or not params.detokenize:
        return None
    return tokenizer.decode


def stream_news(pending: dict[int, Sequence], sent: dict[int, tuple[int, int]],
                ) -> list[tuple[int, Sequence, str | None, list[int]]]:
    """(index, sequence, new text, new token ids) of each pending sequence with news since `sent`,
    which it advances; drops the finished ones from `pending`. The text is None where the engine
    does not detokenize the sequence."""
    news = []
    for index, seq in list(pending.items()):
        num_tokens, num_chars = sent[index]
        num_output, finished = seq.num_output_tokens, seq.is_finished
        if num_output == num_tokens and not finished:
            continue
        if finished:
            del pending[index]
        detokenizer, text, end = seq.detokenizer, None, 0
        if detokenizer is not None:
            full = detokenizer.text
            end = len(full) if finished else max(num_chars, len(full) - detokenizer.holdback)
            text = full[num_chars:end]
        sent[index] = (num_output, end)
        start = seq.num_prompt_tokens
        news.append((index, seq, text, seq.token_ids[start + num_tokens:start + num_output]))
    return news


def stream_outputs(pending: dict[int, Sequence], sent: dict[int, tuple[int, int]],
                   prompt_of: list[int]) -> list[StreamOutput]:
    """What the pending requests produced since `sent` (stream_news), as StreamOutputs."""
    return [StreamOutput(prompt_of[index] - 1, text, token_ids, seq.is_finished,
                         seq.finish_reason, seq.stop_reason, seq.sample_index)
            for index, seq, text, token_ids in stream_news(pending, sent)]
