"""Hugging Face repo ids resolved offline from a hub cache laid out on disk (HF_HOME), the choice
between local paths and ids, and the errors for a missing repo, a bad revision and no network."""

import fnmatch
import os
import shutil

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoint import hub
from nanovllm.checkpoint.hub import ENGINE_FILES, ModelNotFoundError, resolve_model
from nanovllm.config import Config
from tests.conftest import NUM_NEW_TOKENS

MAIN_SHA = "a" * 40
OTHER_SHA = "b" * 40


def add_snapshot(hf_home, repo_id: str, source: str, sha: str, ref: str | None = "main") -> str:
    """Copy `source` into the hub cache as snapshot `sha` of `repo_id`, `ref` pointing at it."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / sha
    shutil.copytree(source, snapshot)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return str(snapshot)


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf-home"
    (home / "hub").mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.mark.cpu_suite
def test_repo_id_runs_from_the_offline_cache(hf_home, tiny_model, prompts, hf_reference):
    snapshot = add_snapshot(hf_home, "org/tiny", tiny_model, MAIN_SHA)
    with LLM("org/tiny", kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        assert llm.llm_engine.config.model == snapshot
        (output,) = llm.generate([prompts[1]], SamplingParams(
            temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert output["token_ids"] == hf_reference[1]


def test_revision_picks_the_snapshot(hf_home, tiny_model):
    main = add_snapshot(hf_home, "org/tiny", tiny_model, MAIN_SHA)
    other = add_snapshot(hf_home, "org/tiny", tiny_model, OTHER_SHA, ref="v2")
    assert resolve_model("org/tiny") == main
    assert resolve_model("org/tiny", revision="main") == main
    assert resolve_model("org/tiny", revision="v2") == other
    assert resolve_model("org/tiny", revision=OTHER_SHA) == other


def test_bad_revision_names_the_id_the_revision_and_what_was_tried(hf_home, tiny_model):
    add_snapshot(hf_home, "org/tiny", tiny_model, MAIN_SHA)
    with pytest.raises(ModelNotFoundError) as error:
        LLM("org/tiny", revision="no-such-branch")
    message = str(error.value)
    assert message.startswith("cannot find model 'org/tiny' at revision 'no-such-branch'; tried ")
    assert f"the hub cache '{hf_home / 'hub'}'" in message
    assert message.endswith("no download: HF_HUB_OFFLINE is set")


def test_missing_repo_is_a_file_not_found_error(hf_home):
    with pytest.raises(FileNotFoundError, match="cannot find model 'org/missing'; tried the hub "
                                                f"cache '{hf_home / 'hub'}'"):
        LLM("org/missing")


def test_snapshot_without_weights_names_what_it_lacks(hf_home, tiny_model, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(os.path.join(tiny_model, "config.json"), partial)
    add_snapshot(hf_home, "org/partial", str(partial), MAIN_SHA)
    with pytest.raises(ModelNotFoundError, match="has a snapshot without \\*.safetensors"):
        resolve_model("org/partial")


def test_sharded_snapshot_missing_a_shard_names_it(hf_home, tiny_model, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model, sharded)
    (sharded / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model.safetensors", "b": "model-2.safetensors"}}')
    add_snapshot(hf_home, "org/sharded", str(sharded), MAIN_SHA)
    with pytest.raises(ModelNotFoundError, match="without model-2.safetensors"):
        resolve_model("org/sharded")


def test_gguf_file_in_a_repo(hf_home, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "model-Q4_0.gguf").write_bytes(b"GGUF")
    snapshot = add_snapshot(hf_home, "org/model-GGUF", str(repo), MAIN_SHA)
    path = resolve_model("org/model-GGUF", gguf_file="model-Q4_0.gguf")
    assert path == os.path.join(snapshot, "model-Q4_0.gguf")
    with pytest.raises(ModelNotFoundError, match="'org/model-GGUF'.*without 'other.gguf'"):
        resolve_model("org/model-GGUF", gguf_file="other.gguf")


def test_no_network_names_the_download_failure(hf_home, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ModelNotFoundError, match="cannot find model 'org/tiny'; tried the hub "
                                                 ".*; downloading from the hub: "):
        resolve_model("org/tiny")


def test_download_fetches_only_what_the_engine_reads_after_the_cache(hf_home, tiny_model,
                                                                    monkeypatch):
    calls = []
    cached = hf_home / "hub" / "models--org--tiny" / "snapshots" / MAIN_SHA

    def fake_snapshot_download(repo_id, local_files_only=False, **kwargs):
        calls.append((local_files_only, kwargs))
        if not local_files_only:
            return add_snapshot(hf_home, repo_id, tiny_model, MAIN_SHA)
        if not cached.is_dir():
            raise FileNotFoundError("not in the cache")
        return str(cached)

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub, "hub_offline", lambda: False)
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    assert resolve_model("org/tiny", revision="main").endswith(MAIN_SHA)
    assert [local for local, _ in calls] == [True, False]
    kwargs = calls[1][1]
    assert kwargs["revision"] == "main" and kwargs["cache_dir"] == str(hf_home / "hub")
    assert kwargs["allow_patterns"] == list(ENGINE_FILES)

    def fetched(name: str) -> bool:
        return (any(fnmatch.fnmatch(name, p) for p in kwargs["allow_patterns"])
                and not any(fnmatch.fnmatch(name, p) for p in kwargs["ignore_patterns"]))

    for name in ("config.json", "tokenizer.json", "model-00001-of-00002.safetensors",
                 "model.safetensors.index.json", "generation_config.json"):
        assert fetched(name), name
    for name in ("pytorch_model.bin", "original/consolidated.safetensors", "model.onnx",
                 "README.md", "model.gguf"):
        assert not fetched(name), name
    calls.clear()  # now complete in the cache: no download
    assert resolve_model("org/tiny").endswith(MAIN_SHA)
    assert [local for local, _ in calls] == [True]


# ---- local paths ---------------------------------------------------------------------------------

def test_local_directory_wins_over_a_repo_id(tiny_model, tmp_path, monkeypatch):
    local = tmp_path / "org" / "tiny"
    shutil.copytree(tiny_model, local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny") == "org/tiny"


def test_revision_of_a_local_path_is_refused(tiny_model):
    with pytest.raises(ValueError, match=f"revision='main' applies to Hugging Face repo ids, "
                                         f"but '{tiny_model}' is a local path"):
        Config(tiny_model, revision="main")


@pytest.mark.parametrize("model", ["/no/such/dir", "./nope", "a/b/c", "~/nope", "org--x/y"])
def test_a_path_that_is_no_repo_id_does_not_exist(model):
    with pytest.raises(FileNotFoundError, match="does not exist \\(nor is it a Hugging Face repo"):
        resolve_model(os.path.expanduser(model))


def test_a_file_that_is_not_gguf_is_refused(tiny_model):
    path = os.path.join(tiny_model, "config.json")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        resolve_model(path)


def test_option_types_are_checked(tiny_model):
    with pytest.raises(TypeError, match="revision must be a str or None, got 3"):
        Config(tiny_model, revision=3)
    with pytest.raises(TypeError, match="gguf_file must be a str or None"):
        Config(tiny_model, gguf_file=b"x.gguf")
    with pytest.raises(FileNotFoundError, match="gguf_file='x.gguf' is not in"):
        Config(tiny_model, gguf_file="x.gguf")
