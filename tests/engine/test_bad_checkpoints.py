"""A broken checkpoint fails LLM() start-up with an error naming the file and what is wrong."""

import json
import os
import re
import shutil

import pytest
import torch
import transformers

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=128)


@pytest.fixture
def checkpoint(tiny_model, tmp_path) -> str:
    """A copy of the tiny model to break."""
    return shutil.copytree(tiny_model, tmp_path / "ckpt").as_posix()


def quoted(path: str) -> str:
    return re.escape(repr(path))


def edit_config(checkpoint: str, edit) -> str:
    path = os.path.join(checkpoint, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config)
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def assert_engine_released():
    assert not torch.distributed.is_initialized()


# ---- config.json --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,message", [
    ('{"architectures": ["Qwen3ForCausalLM"],', "Expecting property name enclosed"),
    ("", "Expecting value: line 1 column 1"),
    (b"\xff\xfe{}", "invalid start byte"),
])
def test_invalid_json_names_the_file_and_the_error(checkpoint, text, message):
    path = os.path.join(checkpoint, "config.json")
    with open(path, "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=f"{quoted(path)} is not valid JSON: .*{message}"):
        LLM(checkpoint, **OPTIONS)


def test_json_that_is_not_an_object_is_refused(checkpoint):
    path = os.path.join(checkpoint, "config.json")
    with open(path, "w") as f:
        json.dump(["Qwen3ForCausalLM"], f)
    with pytest.raises(ValueError, match=f"{quoted(path)} must hold a JSON object, got list"):
        LLM(checkpoint, **OPTIONS)


@pytest.mark.parametrize("fields,named", [
    (["hidden_size"], "hidden_size"),
    (["num_hidden_layers", "vocab_size"], "vocab_size, num_hidden_layers"),
    (["num_attention_heads", "intermediate_size"], "intermediate_size, num_attention_heads"),
    (["max_position_embeddings"], "max_position_embeddings"),
])
def test_missing_fields_are_named(checkpoint, fields, named):
    path = edit_config(checkpoint, lambda c: [c.pop(f) for f in fields])
    with pytest.raises(ValueError,
                       match=f"{quoted(path)} is missing required field\\(s\\): {named}$"):
        LLM(checkpoint, **OPTIONS)


@pytest.mark.parametrize("field,value,shown", [
    ("hidden_size", "64", "'64'"),
    ("num_hidden_layers", 0, "0"),
    ("vocab_size", None, "None"),
    ("num_attention_heads", 4.0, "4.0"),
    ("num_key_value_heads", -2, "-2"),
    ("head_dim", True, "True"),
])
def test_bad_field_values_are_named(checkpoint, field, value, shown):
    path = edit_config(checkpoint, lambda c: c.update({field: value}))
    with pytest.raises(ValueError, match=f"{field}={re.escape(shown)} in {quoted(path)} "
                                         "must be a positive int"):
        LLM(checkpoint, **OPTIONS)


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="transformers 4 does not check the fields' types")
@pytest.mark.parametrize("field,value", [("rms_norm_eps", "small"), ("head_dim", None)])
def test_fields_transformers_refuses_are_named(checkpoint, field, value):
    path = edit_config(checkpoint, lambda c: c.update({field: value}))
    with pytest.raises(ValueError, match=f"{quoted(path)} is not a valid model config: "
                                         f"(?s:.*){field}"):
        LLM(checkpoint, **OPTIONS)


# ---- model.safetensors --------------------------------------------------------------------------

@pytest.mark.parametrize("keep", ["half", 5, 0])
def test_truncated_safetensors_names_the_file(checkpoint, keep):
    file = os.path.join(checkpoint, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[:len(data) // 2 if keep == "half" else keep])
    with pytest.raises(ValueError,
                       match=f"cannot read {quoted(file)}: truncated or not a safetensors file"):
        LLM(checkpoint, **OPTIONS)
    assert_engine_released()


# ---- tokenizer ----------------------------------------------------------------------------------

def remove_tokenizer(checkpoint: str):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        os.remove(os.path.join(checkpoint, name))


def test_missing_tokenizer_fails_at_start_up(checkpoint):
    remove_tokenizer(checkpoint)
    with pytest.raises(FileNotFoundError,
                       match=f"no tokenizer in {quoted(checkpoint)}: it needs one of "
                             "tokenizer.json, tokenizer.model, .*skip_tokenizer_init=True"):
        LLM(checkpoint, **OPTIONS)
    assert_engine_released()


def test_tokenizer_config_alone_is_not_a_tokenizer(checkpoint):
    os.remove(os.path.join(checkpoint, "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in {quoted(checkpoint)}"):
        LLM(checkpoint, **OPTIONS)


def test_corrupt_tokenizer_names_the_directory(checkpoint):
    with open(os.path.join(checkpoint, "tokenizer.json"), "w") as f:
        f.write("{broken")
    with pytest.raises(ValueError, match=f"cannot load the tokenizer {quoted(checkpoint)}"):
        LLM(checkpoint, **OPTIONS)
    assert_engine_released()


def test_skip_tokenizer_init_runs_without_tokenizer_files(checkpoint):
    remove_tokenizer(checkpoint)
    with LLM(checkpoint, skip_tokenizer_init=True, **OPTIONS) as llm:
        (out,) = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert out["text"] == "" and len(out["token_ids"]) == 8 and out["finish_reason"] == "length"


def test_skip_tokenizer_init_must_be_a_bool(tiny_model):
    with pytest.raises(TypeError, match="skip_tokenizer_init must be a bool, got 'yes'"):
        LLM(tiny_model, skip_tokenizer_init="yes", **OPTIONS)
