"""The pipe between the server's process and the engine's: one socket pair carrying pickled
messages, each after its length. The engine's end blocks (its loop reads between steps); the
server's end is an asyncio protocol, so the event loop reads each message as it arrives and never
waits to write (the transport buffers), and no thread there waits on the interpreter lock."""

import asyncio
import multiprocessing.connection
import pickle
import socket
import struct
from collections.abc import Callable

HEADER = struct.Struct("!Q")  # the message's length in bytes


def frame(message) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def send(sock: socket.socket, message):
    """Send one message, waiting while the pipe is full."""
    sock.sendall(frame(message))


def receive(sock: socket.socket):
    """The next message, waiting for it; EOFError once the other end has closed."""
    (size,) = HEADER.unpack(_receive_exactly(sock, HEADER.size))
    return pickle.loads(_receive_exactly(sock, size))


def readable(sock: socket.socket, timeout: float | None) -> bool:
    """A message (or the end) has arrived, waiting up to `timeout` seconds (None: for ever)."""
    return bool(multiprocessing.connection.wait([sock], timeout))


def _receive_exactly(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        n = sock.recv_into(view[received:])
        if n == 0:
            raise EOFError("the other end of the pipe has closed")
        received += n
    return buffer


class MessageProtocol(asyncio.Protocol):
    """The server's end on its event loop: `on_message` for each message as it arrives,
    `on_close` once the engine's end has closed; send() never waits."""

    def __init__(self, on_message: Callable[[object], None], on_close: Callable[[], None]):
        self.on_message, self.on_close = on_message, on_close
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.Transport):
        self.transport = transport

    def data_received(self, data: bytes):
        self.buffer += data
        while len(self.buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.buffer)
            end = HEADER.size + size
            if len(self.buffer) < end:
                return  # the rest of the message is on its way
            message = pickle.loads(self.buffer[HEADER.size:end])
            del self.buffer[:end]
            self.on_message(message)

    def connection_lost(self, exc: Exception | None):
        self.on_close()

    def send(self, message):
        self.transport.write(frame(message))
