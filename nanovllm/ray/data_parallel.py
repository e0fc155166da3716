"""DataParallelLLM: replicas of the engine as Ray actors, a batch split among them by its expected
tokens. `LLM(model, data_parallel_size=N)` returns one; `import nanovllm` never imports Ray."""

import dataclasses
import heapq
import os
import types
from dataclasses import dataclass

from nanovllm.checkpoint.hf_config import load_hf_config
from nanovllm.checkpoint.tokenizer import load_tokenizer
from nanovllm.config import Config
from nanovllm.engine.requests import as_batch, check_request
from nanovllm.engine.scheduler import check_fits
from nanovllm.ray.replica import EngineReplica, import_ray

DATA_PARALLEL_BACKENDS = ("auto", "ray")  # auto: Ray for data_parallel_size > 1, else in-process
POLL_SECONDS = 0.05
MAX_CONCURRENT_CALLS = 16  # a replica's shards of concurrent generate calls, plus progress
EXIT_SECONDS = 30.0


def uses_ray(options: dict) -> bool:
    """Check the data-parallel options; True if the engine runs as Ray replicas."""
    size = options.get("data_parallel_size", 1)
    if not isinstance(size, int) or isinstance(size, bool):
        raise TypeError(f"data_parallel_size must be an int, got {size!r}")
    if size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {size}")
    backend = options.get("data_parallel_backend", "auto")
    if backend not in DATA_PARALLEL_BACKENDS:
        raise ValueError(f"data_parallel_backend={backend!r} is not one of "
                         f"{DATA_PARALLEL_BACKENDS}")
    return size > 1 or backend == "ray"


def balance(costs: list[int], num_shards: int) -> list[list[int]]:
    """Indices of `costs` in shards of near-equal cost (costliest first, to the lightest shard)."""
    loads = [(0, shard) for shard in range(num_shards)]
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, shard = heapq.heappop(loads)
        shards[shard].append(i)
        heapq.heappush(loads, (load + costs[i], shard))
    return [sorted(shard) for shard in shards]


@dataclass(eq=False)
class Replica:
    actor: object  # a Ray actor handle of EngineReplica
    limits: tuple[int, int, int] = (0, 0, 0)  # max_model_len, block size, KV blocks


@dataclass(eq=False)
class _Shard:
    replica: Replica
    indices: list[int]
    outputs: object  # ObjectRefGenerator of (index in the shard, output)
    pending: set[int]  # shard positions not yet returned


def _check_option_names(options: dict):
    known = [f.name for f in dataclasses.fields(Config) if f.init and f.name != "model"]
    for name in options:
        if name not in known:
            raise TypeError(f"unknown option {name!r}; valid options are: "
                            f"{', '.join(known + ['data_parallel_size', 'data_parallel_backend'])}")
    tp = options.get("tensor_parallel_size", 1)
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")


def replica_resources(ray, options: dict) -> tuple[str, dict]:
    """(device, the Ray resources of one replica's actor): a GPU per tensor-parallel rank."""
    tp = options.get("tensor_parallel_size", 1)
    device = options.get("device", "auto")
    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return device, ({"num_gpus": tp, "num_cpus": 1} if device == "cuda" else {"num_cpus": tp})


class DataParallelLLM:
    """`data_parallel_size` engines, each an `LLM` in a Ray actor (docs/architecture.md)."""

    def __init__(self, model: str, data_parallel_size: int = 1, data_parallel_backend: str = "ray",
                 **options):
        uses_ray({"data_parallel_size": data_parallel_size,
                  "data_parallel_backend": data_parallel_backend})
        _check_option_names(options)
        self.ray = ray = import_ray(f"data_parallel_size={data_parallel_size}")
        self.replicas: list[Replica] = []
        self._exited = False
        model = os.path.expanduser(os.fspath(model))
        from nanovllm.models import MODELS

        self.vocab_size = load_hf_config(model, MODELS).vocab_size
        skip = options.get("skip_tokenizer_init", False)
        self.tokenizer = load_tokenizer(types.SimpleNamespace(model=model,
                                                              skip_tokenizer_init=skip))
        self.num_rerun_requests = 0  # requests re-run because their replica died
        if not ray.is_initialized():
            ray.init()
        self._start(model, options, data_parallel_size)

    def _start(self, model: str, options: dict, num_replicas: int):
        """Start every replica at once; any failure stops them all and raises."""
        ray = self.ray
        device, resources = replica_resources(ray, options)
        kind = "GPU" if device == "cuda" else "CPU"
        need = num_replicas * resources[f"num_{kind.lower()}s"]
        have = ray.cluster_resources().get(kind, 0)
        if have < need:
            raise ValueError(f"data_parallel_size={num_replicas} replicas of "
                             f"tensor_parallel_size={options.get('tensor_parallel_size', 1)} "
                             f"need {need} {kind}s; the Ray cluster has {have:g}")
        actor_class = ray.remote(EngineReplica).options(
            max_concurrency=MAX_CONCURRENT_CALLS, max_restarts=0, **resources)
        self.replicas = [Replica(actor_class.remote()) for _ in range(num_replicas)]
        refs = [r.actor.start.remote(model, {**options, "device": device}) for r in self.replicas]
        try:
            for replica, limits in zip(self.replicas, ray.get(refs)):
                replica.limits = limits
        except BaseException:
            self.exit()
            raise

    def __getattr__(self, name: str):
        from nanovllm.llm import LLM

        if not name.startswith("_") and hasattr(LLM, name):
            raise AttributeError(f"LLM.{name} runs on one engine; with data-parallel replicas use "
                                 "generate or chat")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    def _check_alive(self):
        if self._exited:
            raise RuntimeError("this LLM has exited; create a new one")
        if not self.replicas:
            raise RuntimeError("every data-parallel replica has died; create a new LLM")

    def _validate(self, prompts, sampling_params) -> tuple[list[list[int]], list]:
        """The batch as token ids, checked as one engine checks it, before any of it is sent."""
        prompts, sampling_params = as_batch(prompts, sampling_params)
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        max_model_len, block_size, _ = self.replicas[0].limits
        num_blocks = min(r.limits[2] for r in self.replicas)
        for i, (tokens, sp) in enumerate(zip(token_lists, sampling_params)):
            check_request(i, tokens, sp, self.vocab_size)
            try:
                check_fits(len(tokens), sp.max_tokens, max_model_len, block_size, num_blocks,
                           sp.n)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return token_lists, sampling_params

    def generate(self, prompts, sampling_params, use_tqdm: bool = True) -> list[dict]:
        """Run a batch on every replica at once; outputs in input order, as `LLM.generate`."""
        self._check_alive()
        token_lists, sampling_params = self._validate(prompts, sampling_params)
        return self._run(token_lists, sampling_params, use_tqdm)

    def chat(self, messages, sampling_params, use_tqdm: bool = True) -> list[dict]:
        """Reply to one conversation or a list of them, as `LLM.chat`."""
        from nanovllm.llm import conversation_prompts

        self._check_alive()
        return self.generate(conversation_prompts(self.tokenizer, messages), sampling_params,
                             use_tqdm)

    def _submit(self, indices: list[int], prompts: list, params: list) -> list[_Shard]:
        """Send these requests to the live replicas, split by expected tokens."""
        self._check_alive()
        costs = [len(prompts[i]) + params[i].max_tokens for i in indices]
        shards = []
        for replica, shard in zip(self.replicas, balance(costs, len(self.replicas))):
            if shard:
                part = [indices[k] for k in shard]
                outputs = replica.actor.generate.options(num_returns="streaming").remote(
                    [prompts[i] for i in part], [params[i] for i in part])
                shards.append(_Shard(replica, part, outputs, set(range(len(part)))))
        return shards

    def _run(self, prompts: list, params: list, use_tqdm: bool) -> list[dict]:
        from tqdm.auto import tqdm

        ray = self.ray
        outputs: list = [None] * len(prompts)
        shards = self._submit(list(range(len(prompts))), prompts, params)
        with tqdm(total=len(prompts), desc="Generating", unit="req", dynamic_ncols=True,
                  disable=not use_tqdm) as pbar:
            while shards:
                ready, _ = ray.wait([s.outputs for s in shards], num_returns=1,
                                    timeout=POLL_SECONDS)
                for shard in [s for s in shards if s.outputs in ready]:
                    try:
                        position, output = ray.get(next(shard.outputs))
                    except StopIteration:
                        shards.remove(shard)
                        continue
                    except ray.exceptions.RayActorError:
                        shards.remove(shard)
                        self._drop(shard.replica)
                        lost = [shard.indices[k] for k in sorted(shard.pending)]
                        self.num_rerun_requests += len(lost)
                        shards += self._submit(lost, prompts, params)
                        continue
                    shard.pending.discard(position)
                    outputs[shard.indices[position]] = output
                    pbar.update(1)
        return outputs

    def _drop(self, replica: Replica):
        if replica in self.replicas:
            self.replicas.remove(replica)
            self.ray.kill(replica.actor)

    def _broadcast(self, method: str, *args, **kwargs) -> list:
        """Run `LLM.<method>(*args, **kwargs)` on every live replica; returns their results."""
        self._check_alive()
        ray = self.ray
        refs = [(r, r.actor.call.remote(method, args, kwargs)) for r in self.replicas]
        results = []
        for replica, ref in refs:
            try:
                results.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                self._drop(replica)
        self._check_alive()
        return results

    def reset_prefix_cache(self):
        self._broadcast("reset_prefix_cache")

    def update_weights(self, *args, **kwargs):
        self._broadcast("update_weights", *args, **kwargs)

    def update_weights_from_path(self, *args, **kwargs):
        self._broadcast("update_weights_from_path", *args, **kwargs)

    def sleep(self, *args, **kwargs):
        self._broadcast("sleep", *args, **kwargs)

    def wake_up(self, *args, **kwargs):
        self._broadcast("wake_up", *args, **kwargs)

    def exit(self):
        """Stop the engines and remove the actors. Safe to call more than once."""
        if self._exited:
            return
        self._exited = True
        ray, replicas, self.replicas = self.ray, self.replicas, []
        if not ray.is_initialized():  # ray.shutdown() already ended the actors
            return
        refs = [replica.actor.exit.remote() for replica in replicas]
        ray.wait(refs, num_returns=len(refs), timeout=EXIT_SECONDS)
        for replica in replicas:
            ray.kill(replica.actor)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()
