"""Control plane for tensor parallelism: rank 0 broadcasts each call to the worker ranks.

A shared-memory segment holds the pickled `(method, args)` behind an 8-byte length; per worker, a
`call` semaphore wakes it and an `ack` one says it has read the call. (Not Events: their set()
waits for the sleepers, so a killed worker would hang rank 0.) A call too large for the segment
first moves everyone to a larger one.
"""

import os
import pickle
import uuid
from multiprocessing import shared_memory

HEADER_BYTES = 8
_REATTACH = "__reattach__"
NO_MAIN_GUARD_EXIT_CODE = 86  # a worker's exit code when it re-ran an unguarded LLM(...) script


class WorkerDiedError(RuntimeError):
    def __init__(self, message: str, exitcode: int | None = None):
        super().__init__(message)
        self.exitcode = exitcode


class ShmChannel:
    def __init__(self, ctx, num_workers: int, size: int = 1 << 20):
        self.base_name = f"nanovllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.generation = 0
        self.shm = shared_memory.SharedMemory(name=self._name(), create=True, size=size)
        self.call_semaphores = [ctx.Semaphore(0) for _ in range(num_workers)]
        self.ack_semaphores = [ctx.Semaphore(0) for _ in range(num_workers)]
        self.processes = []
        self.pending_ack = False

    def _name(self) -> str:
        return f"{self.base_name}-{self.generation}"

    def worker_end(self, rank: int) -> "WorkerEnd":
        return WorkerEnd(self._name(), self.call_semaphores[rank - 1],
                         self.ack_semaphores[rank - 1], os.getpid())

    def send(self, method: str, *args):
        """Publish a call to all workers (waits until they have read the previous one)."""
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        self.wait_acks()
        if HEADER_BYTES + len(payload) > self.shm.size:
            self._grow(HEADER_BYTES + len(payload))
        self._publish(payload)

    def _publish(self, payload: bytes):
        self.shm.buf[:HEADER_BYTES] = len(payload).to_bytes(HEADER_BYTES, "little")
        self.shm.buf[HEADER_BYTES:HEADER_BYTES + len(payload)] = payload
        self._wake_workers()

    def _wake_workers(self):
        for semaphore in self.call_semaphores:
            semaphore.release()
        self.pending_ack = True

    def _grow(self, needed: int):
        old = self.shm
        self.generation += 1
        size = max(needed, 2 * old.size)
        self.shm = shared_memory.SharedMemory(name=self._name(), create=True, size=size)
        payload = pickle.dumps((_REATTACH, (self._name(),)))
        old.buf[:HEADER_BYTES] = len(payload).to_bytes(HEADER_BYTES, "little")
        old.buf[HEADER_BYTES:HEADER_BYTES + len(payload)] = payload
        self._wake_workers()
        self.wait_acks()
        old.close()
        old.unlink()

    def wait_acks(self, poll_seconds: float = 0.2):
        """Wait until every worker has read the last call; raise if one of them has died."""
        if not self.pending_ack:
            return
        for semaphore in self.ack_semaphores:
            while not semaphore.acquire(timeout=poll_seconds):
                self.check_workers_alive()
        self.pending_ack = False

    def check_workers_alive(self):
        error = self.dead_worker_error()
        if error is not None:
            raise error

    def dead_worker_error(self, grace_seconds: float = 0.0) -> WorkerDiedError | None:
        """An error naming the first worker that exited, if any (after `grace_seconds`)."""
        for rank, process in enumerate(self.processes, start=1):
            process.join(grace_seconds)
            if not process.is_alive():
                return WorkerDiedError(f"tensor-parallel worker rank {rank} died "
                                       f"(exit code {process.exitcode})", process.exitcode)
        return None

    def close(self):
        self.shm.close()
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


class WorkerEnd:
    """A worker's side of the channel (picklable: it travels to the spawned process)."""

    def __init__(self, name: str, call_semaphore, ack_semaphore, parent_pid: int):
        self.name = name
        self.call_semaphore = call_semaphore
        self.ack_semaphore = ack_semaphore
        self.parent_pid = parent_pid
        self.shm = None

    def receive(self) -> tuple[str, tuple]:
        """Block until the next call: (method, args), or ("exit", ()) once rank 0 is gone."""
        while True:
            if self.shm is None:
                self.shm = shared_memory.SharedMemory(name=self.name)
            while not self.call_semaphore.acquire(timeout=1.0):
                if os.getppid() != self.parent_pid:
                    return "exit", ()
            size = int.from_bytes(self.shm.buf[:HEADER_BYTES], "little")
            method, args = pickle.loads(self.shm.buf[HEADER_BYTES:HEADER_BYTES + size])
            self.ack_semaphore.release()
            if method != _REATTACH:
                return method, args
            self.shm.close()
            self.shm, self.name = None, args[0]

    def close(self):
        if self.shm is not None:
            self.shm.close()
