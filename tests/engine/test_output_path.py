"""The per-token path from the engine core to a stream: the engine core's output socket, the API
server's reader of it, and `merge` of one stream (no engine needed)."""

import asyncio
import tempfile

import pytest
import zmq

from kestrel.core.core_process import output_socket
from kestrel.engine.async_llm import _OutputReader
from kestrel.entrypoints.openai.serving_engine import merge

WAIT_S = 5.0  # a bound on waits that should end at once, so that a bug fails instead of hanging


@pytest.fixture
def address():
    with tempfile.TemporaryDirectory(prefix="kestrel-test-") as folder:
        yield f"ipc://{folder}/output"


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_output_socket_queues_past_the_default_high_water_mark_without_blocking(address, context):
    # With ZeroMQ's default high-water mark (1000) the non-blocking send of the 1001st message, none
    # read yet, would raise zmq.Again; the engine core's step loop must never wait on the front end.
    sender = output_socket(address)
    try:
        for i in range(3000):
            sender.send_multipart((b"O", str(i).encode()), zmq.NOBLOCK)
        receiver = context.socket(zmq.PULL)
        receiver.bind(address)
        received = [receiver.recv_multipart()[1] for _ in range(3000)]
        receiver.close(linger=0)
    finally:
        sender.close(linger=0)
    assert received == [str(i).encode() for i in range(3000)]


def test_reader_takes_queued_messages_then_wakes_for_later_ones(address, context):
    receiver = context.socket(zmq.PULL)
    receiver.bind(address)
    sender = context.socket(zmq.PUSH)
    sender.connect(address)

    async def scenario() -> list[list[bytes]]:
        loop = asyncio.get_running_loop()
        reader = _OutputReader(receiver, loop.create_future())
        try:
            for i in range(3):
                sender.send_multipart((b"O", b"queued %d" % i))
            got = [await asyncio.wait_for(reader.next_message(), WAIT_S) for _ in range(3)]
            # Nothing is queued now: the reader sleeps until the socket's descriptor wakes it.
            loop.call_later(0.05, sender.send_multipart, (b"O", b"later"))
            got.append(await asyncio.wait_for(reader.next_message(), WAIT_S))
            return got
        finally:
            reader.close()

    try:
        got = asyncio.run(scenario())
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
    assert got == [[b"O", b"queued 0"], [b"O", b"queued 1"], [b"O", b"queued 2"], [b"O", b"later"]]


def test_reader_reads_what_arrives_within_the_exit_drain_time_then_ends(address, context):
    receiver = context.socket(zmq.PULL)
    receiver.bind(address)
    sender = context.socket(zmq.PUSH)
    sender.connect(address)

    async def scenario() -> list[list[bytes] | None]:
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        reader = _OutputReader(receiver, exited)
        try:
            waiting = asyncio.ensure_future(reader.next_message())
            await asyncio.sleep(0.02)
            exited.set_result(500)  # the process ended; its last message may take up to 500 ms
            loop.call_later(0.05, sender.send_multipart, (b"D", b"last words"))
            last = await asyncio.wait_for(waiting, WAIT_S)
            after = await asyncio.wait_for(reader.next_message(), WAIT_S)
            return [last, after]
        finally:
            reader.close()

    try:
        last, after = asyncio.run(scenario())
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
    assert last == [b"D", b"last words"]
    assert after is None


def test_merge_of_one_stream_closes_it_when_the_consumer_stops():
    closed = []

    async def outputs():
        try:
            for i in range(10):
                yield f"token {i}"
        finally:
            closed.append(True)  # AsyncLLM.generate aborts its request here

    async def consume_two() -> list[tuple[int, str]]:
        got = []
        stream = merge([outputs()])
        async for item in stream:
            got.append(item)
            if len(got) == 2:
                break
        await stream.aclose()
        return got

    assert asyncio.run(consume_two()) == [(0, "token 0"), (0, "token 1")]
    assert closed == [True]


def test_merge_of_one_stream_raises_its_error():
    async def failing():
        yield "token 0"
        raise RuntimeError("the engine failed")

    async def consume() -> list[tuple[int, str]]:
        return [item async for item in merge([failing()])]

    with pytest.raises(RuntimeError, match="the engine failed"):
        asyncio.run(consume())
