"""Requests out: the one place a finished request's output, or a stream's next piece, is built
from its sequences."""

from dataclasses import dataclass

from nanovllm.checkpoint.tokenizer import NoTokenizer
from nanovllm.engine.sequence import Sequence


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


def stream_outputs(pending: dict[int, Sequence], sent: dict[int, tuple[int, int]],
                 prompt_of: list[int]) -> list[StreamOutput]:
    """What the pending requests produced since `sent`; drops the finished ones from `pending`."""
    outputs = []
    for index, seq in list(pending.items()):
        num_tokens, num_chars = sent[index]
        if seq.num_output_tokens == num_tokens and not seq.is_finished:
            continue
        text, holdback = seq.detokenizer.text, seq.detokenizer.holdback
        end = len(text) if seq.is_finished else max(num_chars, len(text) - holdback)
        sent[index] = (seq.num_output_tokens, end)
        if seq.is_finished:
            del pending[index]
        start = seq.num_prompt_tokens + num_tokens
        new_tokens = seq.token_ids[start:seq.num_prompt_tokens + seq.num_output_tokens]
        outputs.append(StreamOutput(prompt_of[index] - 1, text[num_chars:end], new_tokens,
                                    seq.is_finished, seq.finish_reason, seq.stop_reason,
                                    seq.sample_index))
    return outputs
