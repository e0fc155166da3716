"""DataParallelEngine: replicas of the engine as Ray actors, a batch split among them by its
expected tokens. `LLM(model, data_parallel_size=N)` drives one; importing it does not import Ray."""

import heapq
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from nanovllm.checkpoint.loader import checkpoint_specs, weight_pairs
from nanovllm.config import check_option_names
from nanovllm.engine.requests import Request, RequestLimits
from nanovllm.ray.replica import EngineReplica, import_ray

DATA_PARALLEL_OPTIONS = ("data_parallel_size", "data_parallel_backend")
DATA_PARALLEL_BACKENDS = ("auto", "ray")  # auto: Ray for data_parallel_size > 1, else in-process
POLL_SECONDS = 0.05
MAX_CONCURRENT_CALLS = 16  # a replica's shards of concurrent calls, plus aborts and broadcasts
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


def replica_resources(ray, options: dict) -> tuple[str, dict]:
    """(device, the Ray resources of one replica's actor): a GPU per tensor-parallel rank."""
    tp = options.get("tensor_parallel_size", 1)
    device = options.get("device", "auto")
    if device == "auto":
        device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return device, ({"num_gpus": tp, "num_cpus": 1} if device == "cuda" else {"num_cpus": tp})


@dataclass(eq=False)
class Replica:
    actor: object  # a Ray actor handle of EngineReplica
    limits: RequestLimits | None = None


@dataclass(eq=False)
class _Shard:
    replica: Replica
    indices: list[int]  # the call's request indices this shard holds
    outputs: object  # ObjectRefGenerator of (index in the shard, output)
    pending: set[int]  # shard positions not yet returned


class DataParallelEngine:
    """`data_parallel_size` engines, each an `LLMEngine` in a Ray actor (docs/architecture.md). The
    front (LLM) checks requests against `limits` before any reaches a replica."""

    def __init__(self, model: str, data_parallel_size: int = 1, data_parallel_backend: str = "ray",
                 **options):
        uses_ray({"data_parallel_size": data_parallel_size,
                  "data_parallel_backend": data_parallel_backend})
        check_option_names(options, DATA_PARALLEL_OPTIONS)
        tp = options.get("tensor_parallel_size", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        self.ray = ray = import_ray(f"data_parallel_size={data_parallel_size}")
        self.replicas: list[Replica] = []
        self._exited = False
        self._lock = threading.Lock()
        self._active_calls = 0  # as_completed calls with shards on the replicas
        self.num_rerun_requests = 0  # requests re-run because their replica died
        if not ray.is_initialized():
            # Ray's driver lives in the thread that starts it: one that ends takes it along.
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("a data-parallel LLM started outside the main thread needs Ray "
                                   "started first: call ray.init() in the main thread")
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
            for replica, ref in zip(self.replicas, refs):
                replica.limits, self.tokenizer = self._get(ref)
        except BaseException:
            self.exit()
            raise

    def _get(self, ref):
        """ray.get, an engine's error raised as itself (not wrapped in a RayTaskError)."""
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, Exception):
                raise cause from None
            raise

    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    @property
    def limits(self) -> RequestLimits:
        """What a request must fit on every replica (the smallest KV pool)."""
        self.check_alive()
        num_blocks = min(r.limits.num_blocks for r in self.replicas)
        return replace(self.replicas[0].limits, num_blocks=num_blocks)

    def check_alive(self):
        if self._exited:
            raise RuntimeError("this LLM has exited; create a new one")
        if not self.replicas:
            raise RuntimeError("every data-parallel replica has died; create a new LLM")

    def _submit(self, indices: list[int], requests: list[Request]) -> list[_Shard]:
        """Send these requests to the live replicas, split by expected tokens."""
        self.check_alive()
        costs = [len(requests[i].token_ids) + requests[i].params.max_tokens for i in indices]
        shards = []
        for replica, shard in zip(self.replicas, balance(costs, len(self.replicas))):
            if shard:
                part = [indices[k] for k in shard]
                outputs = replica.actor.generate.options(num_returns="streaming").remote(
                    [requests[i] for i in part])
                shards.append(_Shard(replica, part, outputs, set(range(len(part)))))
        return shards

    def as_completed(self, requests: list[Request], on_step: Callable | None = None,
                     ) -> Iterator[tuple[int, Any]]:
        """Run checked requests on every replica at once, yielding (index, output) as each
        completes. A replica that dies has its unreturned requests split again over the others;
        an engine error aborts the call's other shards and is raised once they have stopped."""
        with self._lock:
            self._active_calls += 1
        shards: list[_Shard] = []
        try:
            shards = self._submit(list(range(len(requests))), requests)
            while shards:
                yield from self._next_outputs(shards, requests)
        finally:
            self._stop(shards, requests)
            with self._lock:
                self._active_calls -= 1

    def _next_outputs(self, shards: list[_Shard], requests: list[Request]):
        ray = self.ray
        ready, _ = ray.wait([s.outputs for s in shards], num_returns=1, timeout=POLL_SECONDS)
        for shard in [s for s in shards if s.outputs in ready]:
            try:
                position, output = self._get(next(shard.outputs))
            except StopIteration:
                shards.remove(shard)
                continue
            except ray.exceptions.RayActorError:
                shards.remove(shard)
                self._drop(shard.replica)
                lost = [shard.indices[k] for k in sorted(shard.pending)]
                self.num_rerun_requests += len(lost)
                shards += self._submit(lost, requests)
                continue
            shard.pending.discard(position)
            yield shard.indices[position], output

    def _stop(self, shards: list[_Shard], requests: list[Request]):
        """Abort what the shards still run and wait until their streams end, so that the replicas
        are idle again when the call returns or raises."""
        ray = self.ray
        for shard in shards:
            ids = [requests[shard.indices[k]].request_id for k in shard.pending]
            shard.replica.actor.abort.remote(ids)
        for shard in shards:
            try:
                for ref in shard.outputs:
                    ray.get(ref)
            except Exception:  # a replica that died or failed has stopped too
                pass

    def _drop(self, replica: Replica):
        if replica in self.replicas:
            self.replicas.remove(replica)
            self.ray.kill(replica.actor)

    def _broadcast(self, method: str, *args) -> list:
        """`LLMEngine.<method>(*args)` on every live replica, once every replica has passed its
        `check_ready`: a refused operation leaves every replica unchanged."""
        self.check_alive()
        with self._lock:
            if self._active_calls:
                raise RuntimeError(f"{method}() refused: {self._active_calls} generate calls are "
                                   "unfinished; let them finish (or close their iterators) first")
            if method == "update_weights":
                self._on_every_replica("check_ready", method,
                                       [(name, tuple(t.shape)) for name, t in args[0]])
            elif method == "update_weights_from_path":
                self._on_every_replica("check_ready", "update_weights", checkpoint_specs(args[0]))
            elif method in ("sleep", "wake_up"):
                self._on_every_replica("check_ready", method, *args)
            return self._on_every_replica(method, *args)

    def _on_every_replica(self, method: str, *args) -> list:
        refs = [(r, r.actor.call.remote(method, args, {})) for r in self.replicas]
        results = []
        for replica, ref in refs:
            try:
                results.append(self._get(ref))
            except self.ray.exceptions.RayActorError:
                self._drop(replica)
        self.check_alive()
        return results

    def stream(self, requests: list[Request]):
        raise NotImplementedError("LLM.stream runs on one engine; with data-parallel replicas "
                                  "use generate, as_completed or chat")

    def reset_prefix_cache(self) -> bool:
        return all(self._broadcast("reset_prefix_cache"))

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        return [result for results in self._broadcast("collective_rpc", method, args, kwargs)
                for result in results]

    def update_weights(self, weights):
        self._broadcast("update_weights", weight_pairs(weights))

    def update_weights_from_path(self, path: str):
        self._broadcast("update_weights_from_path", path)

    def sleep(self, level: int = 1):
        self._broadcast("sleep", level)

    def wake_up(self, tags: list[str] | None = None):
        self._broadcast("wake_up", tags)

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
