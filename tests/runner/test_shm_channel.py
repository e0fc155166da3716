"""The shared-memory control plane: calls reach workers in order, and a call larger than the
segment moves everyone to a larger one."""

import glob
import multiprocessing as mp

from nanovllm.runner.shm_channel import ShmChannel, WorkerEnd


def echo_worker(end: WorkerEnd, results):
    while True:
        method, args = end.receive()
        results.put((method, len(args[0]) if args else 0))
        if method == "exit":
            end.close()
            return


def test_calls_arrive_in_order_and_the_segment_grows():
    ctx = mp.get_context("spawn")
    channel = ShmChannel(ctx, num_workers=1, size=256)
    results = ctx.Queue()
    worker = ctx.Process(target=echo_worker, args=(channel.worker_end(1), results), daemon=True)
    worker.start()
    channel.processes = [worker]
    try:
        for size in (10, 5000, 20, 100_000, 30):
            channel.send("run", b"x" * size)
        channel.send("exit")
        received = [results.get(timeout=30) for _ in range(6)]
        worker.join(timeout=30)
    finally:
        channel.close()
    assert received == [("run", 10), ("run", 5000), ("run", 20), ("run", 100_000), ("run", 30),
                        ("exit", 0)]
    assert channel.generation == 2 and channel.shm.size >= 100_000
    assert not glob.glob(f"/dev/shm/{channel.base_name}*")  # old segments unlinked on growth
