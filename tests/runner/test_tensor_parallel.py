"""Tensor parallelism on CPU (gloo): identical tokens at every size, exact shards, failures."""

import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoint.loader import load_model
from nanovllm.config import Config
from nanovllm.engine import llm_engine
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.runner.shm_channel import WorkerDiedError
from nanovllm.testing.tiny_model import write_tiny_qwen3
from tests.conftest import _hf_model, hf_greedy
from tests.engine.test_generate import GREEDY, greedy_twice_under_preemption

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
pytestmark = pytest.mark.cpu_suite  # exact against transformers on the CPU (see conftest)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tp2_matches_transformers_with_chunking_preemption_and_prefix_hits(
        tiny_model, prompts, hf_reference, backend):
    # 8 blocks of 16 tokens hold at most two requests: preemption; a 20-token budget chunks
    # prompts; the second pass hits the prefix cache. Each rank has 2 query heads and 1 KV head.
    with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=8,
             max_num_batched_tokens=20, attention_backend=backend) as llm:
        first, second = greedy_twice_under_preemption(llm, prompts)
    assert first == hf_reference
    assert second == hf_reference[::-1]


def test_tp2_prompt_logprobs_equal_transformers(tiny_model, prompts):
    """Every rank runs lm_head over the prompt positions, in slices; rank 0 reports them.
    Tolerance: float32 logits summed in another order across ranks, ~1e-6 relative."""
    prompt = prompts[3]
    with torch.no_grad():
        logits = _hf_model(tiny_model)(torch.tensor([prompt])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    with LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=16,
             max_num_batched_tokens=20) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    got = [entries[token].logprob for token, entries in zip(prompt[1:], out.prompt_logprobs[1:])]
    expected = reference[range(len(prompt) - 1), prompt[1:]].tolist()
    assert got == pytest.approx(expected, abs=1e-5)


@pytest.fixture(scope="module")
def tiny_model_8_heads(tmp_path_factory) -> str:
    """8 query / 4 KV heads, so that 4 ranks divide them."""
    path = str(tmp_path_factory.mktemp("tiny-8-heads"))
    write_tiny_qwen3(path, seed=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    return path


def test_tp4_equals_tp1_and_transformers(tiny_model_8_heads, prompts):
    expected = [hf_greedy(tiny_model_8_heads, p, 12) for p in prompts[:5]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(tiny_model_8_heads, tensor_parallel_size=4, kvcache_block_size=16,
             num_kvcache_blocks=32) as llm:
        outputs = llm.generate(prompts[:5], params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected


def test_each_rank_loads_its_slice_of_every_tensor(tiny_model_8_heads, monkeypatch):
    """Each rank of 2, built in-process, holds its piece of every checkpoint tensor."""
    config = Config(tiny_model_8_heads, device="cpu")
    hf = config.hf_config
    ckpt = load_file(os.path.join(tiny_model_8_heads, "model.safetensors"))
    q_rows = hf.num_attention_heads * hf.head_dim // 2
    kv_rows = hf.num_key_value_heads * hf.head_dim // 2
    inter, vocab = hf.intermediate_size // 2, hf.vocab_size // 2
    for rank in range(2):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=rank: r)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        model = Qwen3ForCausalLM(hf, "torch")
        load_model(model, tiny_model_8_heads)
        params = dict(model.named_parameters())
        rows = _rank_slicer(rank)
        pre = "model.layers.1."
        qkv = params[pre + "self_attn.qkv_proj.weight"]
        torch.testing.assert_close(qkv, torch.cat([
            ckpt[pre + "self_attn.q_proj.weight"][rows(q_rows)],
            ckpt[pre + "self_attn.k_proj.weight"][rows(kv_rows)],
            ckpt[pre + "self_attn.v_proj.weight"][rows(kv_rows)]]))
        torch.testing.assert_close(params[pre + "self_attn.o_proj.weight"],
                                   ckpt[pre + "self_attn.o_proj.weight"][:, rows(q_rows)])
        torch.testing.assert_close(params[pre + "mlp.gate_up_proj.weight"],
                                   torch.cat([ckpt[pre + "mlp.gate_proj.weight"][rows(inter)],
                                              ckpt[pre + "mlp.up_proj.weight"][rows(inter)]]))
        torch.testing.assert_close(params[pre + "mlp.down_proj.weight"],
                                   ckpt[pre + "mlp.down_proj.weight"][:, rows(inter)])
        torch.testing.assert_close(params["model.embed_tokens.weight"],
                                   ckpt["model.embed_tokens.weight"][rows(vocab)])
        for name in ("self_attn.q_norm.weight", "input_layernorm.weight"):
            torch.testing.assert_close(params[pre + name], ckpt[pre + name])


def _rank_slicer(rank: int):
    """rows(n): the slice of n rows (or columns) that `rank` holds."""
    return lambda n: slice(rank * n, (rank + 1) * n)


def test_tp_size_that_does_not_divide_heads_is_an_error(tiny_model):
    with pytest.raises(ValueError,
                       match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLM(tiny_model, tensor_parallel_size=3)


def check_killed_worker_raises(llm: LLM, max_tokens: int):
    """Kill rank 1 mid-generate: within seconds a step raises WorkerDiedError naming it, the
    engine is closed and its shared-memory segment gone."""
    segment = llm.llm_engine.channel.base_name
    assert glob.glob(f"/dev/shm/{segment}*")
    for prompt in ([1, 2, 3], [4, 5]):
        llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    llm.step()
    llm.llm_engine.processes[0].kill()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1 died"):
        while True:
            llm.step()
    assert time.monotonic() - start < 10
    assert not glob.glob(f"/dev/shm/{segment}*")
    with pytest.raises(RuntimeError, match="has exited"):
        llm.step()


def test_killed_worker_raises_and_leaves_no_segment(tiny_model):
    llm = LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=64)
    check_killed_worker_raises(llm, max_tokens=50)


def test_an_nccl_abort_that_never_returns_is_given_up_on(tiny_model, monkeypatch):
    """NCCL's abort of a dead worker's collectives may never return: exit gives up on it after
    NCCL_ABORT_SECONDS, and another LLM is refused until it ends (over gloo, a stuck abort)."""
    release = threading.Event()

    def stuck_abort():
        release.wait()
        torch.distributed.destroy_process_group()  # what the abort leaves once it returns

    llm = LLM(tiny_model, tensor_parallel_size=2, kvcache_block_size=16, num_kvcache_blocks=64)
    monkeypatch.setattr(llm_engine, "NCCL_ABORT_SECONDS", 0.5)
    monkeypatch.setattr(llm_engine.LLMEngine, "nccl_abort", None)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *args: "nccl")
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_abort_process_group", stuck_abort)
    check_killed_worker_raises(llm, max_tokens=50)
    assert torch.distributed.is_initialized() and llm_engine.LLMEngine.nccl_abort.is_alive()
    with pytest.raises(RuntimeError, match="NCCL did not abort the collectives waiting for it"):
        LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=8)
    release.set()
    llm_engine.LLMEngine.nccl_abort.join(10)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=8) as again:
        output = again.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
        assert output["finish_reason"] == "length"


def test_worker_dying_at_start_up_is_an_error(tiny_model, monkeypatch, tmp_path):
    # A spawned worker runs sitecustomize from PYTHONPATH: this one exits at once.
    (tmp_path / "sitecustomize.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with pytest.raises(WorkerDiedError, match="worker rank 1 died"):
        LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=8, kvcache_block_size=16)


def test_ctrl_c_leaves_no_worker_or_segment(tiny_model, tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from nanovllm import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({tiny_model!r}, tensor_parallel_size=2, kvcache_block_size=16,
                      num_kvcache_blocks=64)
            print(llm.llm_engine.processes[0].pid, llm.llm_engine.channel.base_name, flush=True)
            while True:
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=40, ignore_eos=True),
                             use_tqdm=False)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)
    worker_pid, segment = proc.stdout.readline().split()
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{worker_pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{worker_pid}") or _is_zombie(worker_pid)
    assert not glob.glob(f"/dev/shm/{segment}*")


def _is_zombie(pid: str) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


def test_two_engines_in_two_processes_at_once(tiny_model, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        from nanovllm import LLM, SamplingParams
        if __name__ == "__main__":
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            with LLM({tiny_model!r}, tensor_parallel_size=2, kvcache_block_size=16,
                     num_kvcache_blocks=64) as llm:
                out = llm.generate([[1, 2, 3]], params, use_tqdm=False)
            print(out[0]["token_ids"])
    """))
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    expected = str(hf_greedy(tiny_model, [1, 2, 3], 8))
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [expected, expected]

