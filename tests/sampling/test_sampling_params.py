"""SamplingParams: vLLM's fields and defaults; a bad value is a TypeError / ValueError naming it."""

import pytest

from nanovllm import SamplingParams


def test_defaults_and_normalisation():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (
        1.0, 1.0, 0, 0.0, None)
    assert (params.max_tokens, params.min_tokens, params.ignore_eos, params.logprobs) == (
        64, 0, False, None)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        1.0, 0.0, 0.0)
    assert params.stop == [] and params.stop_token_ids == [] and params.skip_special_tokens
    assert not params.include_stop_str_in_output and params.uses_only_temperature
    assert SamplingParams(stop="x", stop_token_ids=(3, 4)).stop == ["x"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    for controls in [{"top_k": 5}, {"top_p": 0.5}, {"min_p": 0.1}, {"seed": 1}, {"logprobs": 0},
                     {"repetition_penalty": 1.2}, {"presence_penalty": 0.1},
                     {"frequency_penalty": -0.1}]:
        assert not SamplingParams(**controls).uses_only_temperature, controls
    assert SamplingParams(top_k=-1, temperature=0, stop="a", min_tokens=3).uses_only_temperature


@pytest.mark.parametrize("kwargs,error,message", [
    ({"temperature": "1"}, TypeError, "temperature must be a float, got '1'"),
    ({"temperature": float("inf")}, ValueError, "temperature must be >= 0 .*got inf"),
    ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_p": None}, TypeError, "top_p must be a float, got None"),
    ({"top_k": -2}, ValueError, r"top_k must be 0 or -1 \(off\) or >= 1, got -2"),
    ({"top_k": 2.0}, TypeError, "top_k must be an int, got 2.0"),
    ({"top_k": True}, TypeError, "top_k must be an int, got True"),
    ({"min_p": -0.1}, ValueError, r"min_p must be in \[0, 1\], got -0.1"),
    ({"min_p": 1.1}, ValueError, r"min_p must be in \[0, 1\], got 1.1"),
    ({"seed": "7"}, TypeError, "seed must be an int, got '7'"),
    ({"seed": -1}, ValueError, r"seed must be in \[0, 2\*\*64\), got -1"),
    ({"seed": 2**64}, ValueError, "seed must be in"),
    ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1, got 0"),
    ({"min_tokens": -1}, ValueError, r"min_tokens must be in \[0, max_tokens=64\], got -1"),
    ({"min_tokens": 5, "max_tokens": 4}, ValueError,
     r"min_tokens must be in \[0, max_tokens=4\], got 5"),
    ({"min_tokens": 1.0}, TypeError, "min_tokens must be an int"),
    ({"ignore_eos": 1}, TypeError, "ignore_eos must be a bool, got 1"),
    ({"include_stop_str_in_output": "yes"}, TypeError, "include_stop_str_in_output must be a bool"),
    ({"skip_special_tokens": None}, TypeError, "skip_special_tokens must be a bool, got None"),
    ({"stop": 3}, TypeError, "stop must be a str or a list of str, got 3"),
    ({"stop": ["a", None]}, TypeError, "stop must be a str or a list of str"),
    ({"stop": ["a", ""]}, ValueError, "stop strings must be non-empty"),
    ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be a list of int, got 5"),
    ({"stop_token_ids": [1, "2"]}, TypeError, "stop_token_ids must be a list of int"),
    ({"stop_token_ids": [1, -2]}, ValueError, r"stop_token_ids must be >= 0, got \[1, -2\]"),
    ({"repetition_penalty": 0}, ValueError, r"repetition_penalty must be > 0 \(1 = off\), got 0"),
    ({"repetition_penalty": "x"}, TypeError, "repetition_penalty must be a float"),
    ({"presence_penalty": 2.5}, ValueError, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": -3}, ValueError, r"frequency_penalty must be in \[-2, 2\], got -3"),
    ({"frequency_penalty": float("nan")}, ValueError, "frequency_penalty must be in"),
    ({"logprobs": 21}, ValueError, r"logprobs must be in \[0, 20\], got 21"),
    ({"logprobs": -1}, ValueError, r"logprobs must be in \[0, 20\], got -1"),
    ({"logprobs": 1.0}, TypeError, "logprobs must be an int, got 1.0"),
])
def test_bad_values_name_the_field_value_and_range(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)
