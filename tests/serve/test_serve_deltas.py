"""A handler that falls behind the engine's steps merges what queued up, by choice."""

import asyncio

from nanovllm.serve.engine_client import EngineStopped, RequestStream, merge_deltas
from nanovllm.serve.messages import ChoiceDelta


def test_merge_joins_each_choice_in_order():
    deltas = [ChoiceDelta(0, "a", [1], [{1: -0.5}]), ChoiceDelta(1, "x", [7], None),
              ChoiceDelta(0, "b", [2], [{2: -0.25}]),
              ChoiceDelta(1, "y", [8], None, finish_reason="stop", stop_reason="yy"),
              ChoiceDelta(0, "c", [3], [{3: -1.0}], finish_reason="length")]
    merged = merge_deltas(deltas)
    assert merged == [
        ChoiceDelta(0, "abc", [1, 2, 3], [{1: -0.5}, {2: -0.25}, {3: -1.0}], "length"),
        ChoiceDelta(1, "xy", [7, 8], None, "stop", "yy")]
    assert deltas[0] == ChoiceDelta(0, "a", [1], [{1: -0.5}])  # the inputs are left alone


def test_next_deltas_drains_the_queue_and_keeps_the_end_for_later():
    async def scenario():
        stream = RequestStream([])
        stream.queue.put_nowait([ChoiceDelta(0, "a", [1], None)])
        stream.queue.put_nowait([ChoiceDelta(0, "b", [2], None, finish_reason="stop")])
        stream.queue.put_nowait(None)
        first = await stream.next_deltas()
        return first, await stream.next_deltas(), stream.done

    first, second, done = asyncio.run(scenario())
    assert first == [ChoiceDelta(0, "ab", [1, 2], None, "stop")]
    assert second == [] and done


def test_an_error_after_deltas_is_raised_by_the_next_call():
    async def scenario():
        stream = RequestStream([])
        stream.queue.put_nowait([ChoiceDelta(0, "a", [1], None)])
        stream.queue.put_nowait(EngineStopped("shutting down"))
        first = await stream.next_deltas()
        try:
            await stream.next_deltas()
        except EngineStopped as e:
            return first, str(e)

    first, error = asyncio.run(scenario())
    assert first == [ChoiceDelta(0, "a", [1], None)] and error == "shutting down"
