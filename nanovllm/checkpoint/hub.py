"""A model as users name it: a checkpoint directory, a .gguf file (or a directory holding one), or
a Hugging Face repo id resolved through the hub cache, downloading only what the engine reads."""

import glob
import json
import os
import re

# The files of a repo the engine reads: config, generation config, tokenizer, safetensors weights.
ENGINE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                "merges.txt", "vocab.txt", "spiece.model", "*.tiktoken", "chat_template.jinja",
                "chat_template.json", "*.safetensors", "model.safetensors.index.json")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
TRUE_VALUES = ("1", "ON", "YES", "TRUE")


class ModelNotFoundError(FileNotFoundError):
    """A repo id neither the hub cache nor a download could provide; names each place tried."""


def resolve_model(model: str, revision: str | None = None, gguf_file: str | None = None) -> str:
    """The local path `model` names: a checkpoint directory or a .gguf file."""
    if os.path.exists(model):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face repo ids, but "
                             f"{model!r} is a local path")
        return _local_checkpoint(model, gguf_file)
    if not REPO_ID.match(model) or "--" in model or ".." in model:
        raise FileNotFoundError(f"model path {model!r} does not exist (nor is it a Hugging Face "
                                "repo id such as 'Qwen/Qwen3-0.6B')")
    return _hub_checkpoint(model, revision, gguf_file)


def _local_checkpoint(path: str, gguf_file: str | None) -> str:
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path!r} is a file but not a .gguf file; pass a checkpoint "
                             "directory or a .gguf file")
        if gguf_file is not None and gguf_file != os.path.basename(path):
            raise ValueError(f"gguf_file={gguf_file!r} names another file than {path!r}")
        return path
    if gguf_file is not None:
        file = os.path.join(path, gguf_file)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"gguf_file={gguf_file!r} is not in {path!r}")
        return file
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(glob.glob(os.path.join(glob.escape(path), "*.gguf")))
    if len(ggufs) > 1:
        names = ", ".join(os.path.basename(g) for g in ggufs)
        raise ValueError(f"{path!r} holds several GGUF files ({names}); pick one with gguf_file=")
    return ggufs[0] if ggufs else path  # without either, config.json is reported missing


def hub_cache_dir() -> str:
    """The hub cache as huggingface_hub finds it (HF_HUB_CACHE, else HF_HOME/hub), read now."""
    env = os.environ
    cache_home = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = env.get("HF_HOME") or os.path.join(cache_home, "huggingface")
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expanduser(os.path.expandvars(hub))


def hub_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in TRUE_VALUES or constants.HF_HUB_OFFLINE


def _hub_checkpoint(repo_id: str, revision: str | None, gguf_file: str | None) -> str:
    """The snapshot directory (or its .gguf file): the cache's if complete, else downloaded."""
    from huggingface_hub import snapshot_download

    cache_dir = hub_cache_dir()
    what = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    kwargs = dict(revision=revision, cache_dir=cache_dir)
    if gguf_file is None:
        kwargs.update(allow_patterns=list(ENGINE_FILES), ignore_patterns=["*/*"])
    else:
        kwargs.update(allow_patterns=[gguf_file])
    tried = []
    try:
        snapshot = snapshot_download(repo_id, local_files_only=True, **kwargs)
        lacking = _lacking(snapshot, gguf_file)
        if not lacking:
            return os.path.join(snapshot, gguf_file) if gguf_file else snapshot
        tried.append(f"the hub cache {cache_dir!r} has a snapshot without {lacking}")
    except FileNotFoundError:  # huggingface_hub's LocalEntryNotFoundError
        tried.append(f"the hub cache {cache_dir!r}: no snapshot of {what}")
    except Exception as e:  # huggingface_hub's other errors (a malformed cache)
        tried.append(f"the hub cache {cache_dir!r}: {_first_line(e)}")
    if hub_offline():
        tried.append("no download: HF_HUB_OFFLINE is set")
        raise ModelNotFoundError(f"cannot find model {what}; tried {'; '.join(tried)}")
    try:
        snapshot = snapshot_download(repo_id, **kwargs)
    except Exception as e:  # network, missing repo, unknown revision, gated repo
        tried.append(f"downloading from the hub: {type(e).__name__}: {_first_line(e)}")
        raise ModelNotFoundError(f"cannot find model {what}; tried {'; '.join(tried)}") from e
    lacking = _lacking(snapshot, gguf_file)
    if lacking:
        raise ModelNotFoundError(f"model {what} on the hub has no {lacking}: not a checkpoint "
                                 "the engine can read (safetensors, or a GGUF via gguf_file=)")
    return os.path.join(snapshot, gguf_file) if gguf_file else snapshot


def _lacking(snapshot: str, gguf_file: str | None) -> str:
    """What the snapshot lacks of a checkpoint ("" if nothing)."""
    if gguf_file is not None:
        return "" if os.path.isfile(os.path.join(snapshot, gguf_file)) else repr(gguf_file)
    if not os.path.isfile(os.path.join(snapshot, "config.json")):
        return "config.json"
    index = os.path.join(snapshot, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(snapshot, s))]
        return ", ".join(missing)
    weights = glob.glob(os.path.join(glob.escape(snapshot), "*.safetensors"))
    return "" if weights else "*.safetensors"


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
