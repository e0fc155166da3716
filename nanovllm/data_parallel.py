"""DataParallelLLM: replicas of the engine as Ray actors, a batch split among them by its expected
tokens. `LLM(model, data_parallel_size=N)` returns one; `import nanovllm` never imports Ray."""

import dataclasses
import heapq
import itertools
import os
import types
from dataclasses import dataclass
from time import perf_counter

from nanovllm.config import Config, load_hf_config
from nanovllm.engine.requests import as_batch, check_request, load_tokenizer
from nanovllm.engine.scheduler import check_fits
from nanovllm.replica import EngineReplica, import_ray

DATA_PARALLEL_BACKENDS = ("auto", "ray")  # auto: Ray for data_parallel_size > 1, else in-process
POLL_SECONDS = 0.05
CALLS_PER_REPLICA = 8  # a shard goes as up to this many calls: a death loses only unreturned ones
PROGRESS_SECONDS = 0.5
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
class _Call:
    """One shard of a batch running on a replica."""

    call_id: int
    replica: Replica
    indices: list[int]
    ref: object  # the Ray object ref of its outputs


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
    """`data_parallel_size` engines, each an `LLM` in a Ray actor (README.md, "Data parallel on
    Ray"); a replica that dies has its requests re-run on the others."""

    def __init__(self, model: str, data_parallel_size: int = 1, data_parallel_backend: str = "ray",
                 **options):
        uses_ray({"data_parallel_size": data_parallel_size,
                  "data_parallel_backend": data_parallel_backend})
        _check_option_names(options)
        self.ray = ray = import_ray(f"data_parallel_size={data_parallel_size}")
        self.replicas: list[Replica] = []
        self._exited = False
        model = os.path.expanduser(os.fspath(model))
        self.vocab_size = load_hf_config(model).vocab_size
        skip = options.get("skip_tokenizer_init", False)
        self.tokenizer = load_tokenizer(types.SimpleNamespace(model=model,
                                                              skip_tokenizer_init=skip))
        self._call_ids = itertools.count()
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
            max_concurrency=CALLS_PER_REPLICA * num_replicas + 2, max_restarts=0, **resources)
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

        if not name.startswith("_") and hasattr(LLM, name):  # stream, step, add_request, ...
            raise AttributeError(f"LLM.{name} runs on one engine; with data-parallel replicas use "
                                 "generate or chat")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def data_parallel_size(self) -> int:
        """The replicas alive."""
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

    def _submit(self, indices: list[int], prompts: list, params: list) -> list[_Call]:
        """Send these requests to the live replicas, split by expected tokens."""
        self._check_alive()
        costs = [len(prompts[i]) + params[i].max_tokens for i in indices]
        calls = []
        for replica, shard in zip(self.replicas, balance(costs, len(self.replicas))):
            size = -(-len(shard) // CALLS_PER_REPLICA)
            for start in range(0, len(shard), size):
                part = [indices[k] for k in shard[start:start + size]]
                call_id = next(self._call_ids)
                ref = replica.actor.generate.remote(call_id, [prompts[i] for i in part],
                                                    [params[i] for i in part])
                calls.append(_Call(call_id, replica, part, ref))
        return calls

    def _run(self, prompts: list, params: list, use_tqdm: bool) -> list[dict]:
        from tqdm.auto import tqdm

        ray = self.ray
        outputs: list = [None] * len(prompts)
        calls = self._submit(list(range(len(prompts))), prompts, params)
        pbar = tqdm(total=len(prompts), desc="Generating", unit="req", dynamic_ncols=True,
                    disable=not use_tqdm)
        done, last_progress = 0, perf_counter()
        try:
            while calls:
                ready, _ = ray.wait([c.ref for c in calls], num_returns=1, timeout=POLL_SECONDS)
                for call in [c for c in calls if c.ref in ready]:
                    calls.remove(call)
                    try:
                        results = ray.get(call.ref)
                    except ray.exceptions.RayActorError:
                        self._drop(call.replica)
                        self.num_rerun_requests += len(call.indices)
                        calls += self._submit(call.indices, prompts, params)
                        continue
                    for i, output in zip(call.indices, results):
                        outputs[i] = output
                    done += len(results)
                if use_tqdm and perf_counter() - last_progress >= PROGRESS_SECONDS:
                    last_progress = perf_counter()
                    pbar.n = done + self._in_flight_finished(calls)
                    pbar.refresh()
        finally:
            pbar.n = done
            pbar.close()
        return outputs

    def _in_flight_finished(self, calls: list[_Call]) -> int:
        """Requests finished in calls still running (best effort: 0 for a replica that dies)."""
        ray = self.ray
        live = {call.call_id for call in calls}
        refs = [replica.actor.progress.remote() for replica in self.replicas]
        try:
            counts = ray.get(refs, timeout=PROGRESS_SECONDS)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return 0
        return sum(n for count in counts for call_id, n in count.items() if call_id in live)

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
