"""The checkpoint's tokenizer (or none, for token-id prompts) and its EOS ids."""

import glob
import json
import os

# One of these makes a directory's tokenizer (tokenizer_config.json alone is not one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "*.tiktoken")


class NoTokenizer:
    """The tokenizer of an engine started with skip_tokenizer_init: token ids only."""

    eos_token_id = None

    def _refuse(self, *args, **kwargs):
        raise ValueError("the engine was started with skip_tokenizer_init=True, so it has no "
                         "tokenizer: pass prompts as token ids, without stop strings; text "
                         "prompts, chat() and stream() need a tokenizer")

    encode = decode = apply_chat_template = __call__ = _refuse


def load_tokenizer(config):
    """The checkpoint's tokenizer, or config.tokenizer's (a directory or a repo id); a NoTokenizer
    with skip_tokenizer_init."""
    if config.skip_tokenizer_init:
        return NoTokenizer()
    source = os.path.expanduser(config.tokenizer) if config.tokenizer else config.model
    if source.endswith(".gguf"):
        from nanovllm.checkpoint.gguf import gguf_tokenizer

        return gguf_tokenizer(source)
    directory = glob.escape(source)
    if os.path.isdir(source) and not any(glob.glob(os.path.join(directory, name))
                                         for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {source!r}: it needs one of {', '.join(TOKENIZER_FILES)}; "
            "pass skip_tokenizer_init=True to give prompts as token ids")
    from transformers import AutoTokenizer

    options = {"use_fast": config.tokenizer_mode != "slow"}
    if config.tokenizer and config.tokenizer_revision:
        options["revision"] = config.tokenizer_revision
    try:
        return AutoTokenizer.from_pretrained(source, **options)
    except Exception as e:
        raise ValueError(f"cannot load the tokenizer {source!r}: {e}") from e


def eos_token_ids(tokenizer, config) -> set[int]:
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
