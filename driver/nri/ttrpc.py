"""ttrpc over NRI's multiplexed socket: the transport between the driver and the runtime.

Two framings are stacked on the one unix socket the plugin dials (facts from containerd's
nri pkg/net/multiplex and ttrpc PROTOCOL.md):

* the trunk carries mux frames: a 4-byte big-endian connection id, a 4-byte big-endian
  payload length, the payload. Each connection id is a byte stream of its own; a payload
  longer than ttrpc's largest message plus its header is split over several frames.
  Connection 1 carries the Plugin service (the runtime is the ttrpc client there, we
  serve), connection 2 the Runtime service (we are the client: RegisterPlugin).
* on each connection, ttrpc messages: 4-byte length, 4-byte stream id (both big-endian),
  1-byte type (1 request, 2 response, 3 data), 1-byte flags, then `length` bytes. A
  message over 4 MiB is discarded and answered with RESOURCE_EXHAUSTED. The side that
  starts a call picks an odd stream id, new for every call.

A request's bytes are a ttrpc.Request (service, method, payload); the answer is a
ttrpc.Response with a status (gRPC codes) and the payload. Everything here is unary:
NRI uses no ttrpc streams.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Awaitable, Callable, Iterator

import structlog

from driver.aio import within
from driver._proto.ttrpc import request_pb2

log = structlog.get_logger("driver.nri.ttrpc")

MUX_HEADER = struct.Struct(">II")
MESSAGE_HEADER = struct.Struct(">IIBB")
MESSAGE_LENGTH_MAX = 4 << 20
MUX_PAYLOAD_MAX = MESSAGE_HEADER.size + MESSAGE_LENGTH_MAX

PLUGIN_SERVICE_CONN = 1
RUNTIME_SERVICE_CONN = 2

FLAG_REMOTE_CLOSED = 0x1
FLAG_REMOTE_OPEN = 0x2
FLAG_NO_DATA = 0x4


class MessageType(IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


class Code(IntEnum):
    """The gRPC status codes ttrpc reuses."""
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    FAILED_PRECONDITION = 9
    ABORTED = 10
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class ProtocolError(Exception):
    """The peer broke the framing; the connection cannot go on."""


class ConnectionClosed(Exception):
    """The trunk is gone (the runtime exited or closed us)."""


class RemoteError(Exception):
    """A call's answer had a non-OK status, or a handler wants to answer with one."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{_code_name(code)}: {message}")
        self.code = code
        self.message = message


def _code_name(code: int) -> str:
    try:
        return Code(code).name
    except ValueError:
        return f"code {code}"


def encode_mux(conn_id: int, payload: bytes) -> bytes:
    """Mux frames carrying `payload` on connection `conn_id` (several when it is long)."""
    if not payload:
        return b""
    out = bytearray()
    for start in range(0, len(payload), MUX_PAYLOAD_MAX):
        chunk = payload[start:start + MUX_PAYLOAD_MAX]
        out += MUX_HEADER.pack(conn_id, len(chunk))
        out += chunk
    return bytes(out)


def encode_message(stream_id: int, kind: MessageType, data: bytes, flags: int = 0) -> bytes:
    if len(data) > MESSAGE_LENGTH_MAX:
        raise RemoteError(Code.RESOURCE_EXHAUSTED,
                          f"message length {len(data)} exceed maximum message size of "
                          f"{MESSAGE_LENGTH_MAX}")
    return MESSAGE_HEADER.pack(len(data), stream_id, kind, flags) + data


@dataclass(frozen=True)
class Message:
    stream_id: int
    kind: int
    flags: int
    # None: the message was longer than MESSAGE_LENGTH_MAX and its bytes were dropped.
    data: bytes | None
    length: int


@dataclass
class MuxDecoder:
    """Splits trunk bytes into (connection id, payload) as they arrive."""
    _buffer: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        self._buffer += data
        while len(self._buffer) >= MUX_HEADER.size:
            conn_id, length = MUX_HEADER.unpack_from(self._buffer)
            if length > MUX_PAYLOAD_MAX:
                raise ProtocolError(f"mux frame of {length} bytes on connection {conn_id} "
                                    f"(at most {MUX_PAYLOAD_MAX})")
            end = MUX_HEADER.size + length
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[MUX_HEADER.size:end])
            del self._buffer[:end]
            yield conn_id, payload


@dataclass
class MessageDecoder:
    """Splits one connection's byte stream into ttrpc messages; an oversized message is
    skipped as its bytes arrive (never buffered) and reported with data None."""
    _buffer: bytearray = field(default_factory=bytearray)
    _skipping: int = 0

    def feed(self, data: bytes) -> Iterator[Message]:
        self._buffer += data
        while True:
            if self._skipping:
                dropped = min(self._skipping, len(self._buffer))
                del self._buffer[:dropped]
                self._skipping -= dropped
                if self._skipping:
                    return
            if len(self._buffer) < MESSAGE_HEADER.size:
                return
            length, stream_id, kind, flags = MESSAGE_HEADER.unpack_from(self._buffer)
            if length > MESSAGE_LENGTH_MAX:
                del self._buffer[:MESSAGE_HEADER.size]
                self._skipping = length
                yield Message(stream_id, kind, flags, None, length)
                continue
            end = MESSAGE_HEADER.size + length
            if len(self._buffer) < end:
                return
            body = bytes(self._buffer[MESSAGE_HEADER.size:end])
            del self._buffer[:end]
            yield Message(stream_id, kind, flags, body, length)


# A served method: the request's payload bytes in, the response's payload bytes out.
# Raising RemoteError answers with its status; any other exception answers UNKNOWN.
Handler = Callable[[bytes], Awaitable[bytes]]


@dataclass
class _Channel:
    decoder: MessageDecoder = field(default_factory=MessageDecoder)
    next_stream: int = 1
    pending: dict[int, asyncio.Future] = field(default_factory=dict)


class Endpoint:
    """One end of a multiplexed trunk: serves the methods given for each connection id
    and makes calls on any connection id. Both the plugin and the test's fake runtime are
    built from it, the roles differing only in which connection serves what."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 services: dict[int, dict[tuple[str, str], Handler]] | None = None) -> None:
        self._reader = reader
        self._writer = writer
        self._services = services or {}
        self._channels: dict[int, _Channel] = {}
        self._handlers: set[asyncio.Task] = set()
        self._closed = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _channel(self, conn_id: int) -> _Channel:
        channel = self._channels.get(conn_id)
        if channel is None:
            channel = self._channels[conn_id] = _Channel()
        return channel

    async def run(self) -> None:
        """Read and dispatch until the trunk closes; raises ConnectionClosed (EOF) or
        ProtocolError. Pending calls fail with the same error."""
        mux = MuxDecoder()
        try:
            while True:
                data = await self._reader.read(65536)
                if not data:
                    raise ConnectionClosed("the runtime closed the NRI connection")
                for conn_id, payload in mux.feed(data):
                    channel = self._channel(conn_id)
                    for message in channel.decoder.feed(payload):
                        self._dispatch(conn_id, channel, message)
        except (OSError, asyncio.IncompleteReadError) as err:
            self._fail(ConnectionClosed(f"NRI connection lost: {err}"))
            raise ConnectionClosed(f"NRI connection lost: {err}") from err
        except BaseException as err:
            self._fail(err)
            raise
        finally:
            await self.close()

    def _fail(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
        for channel in self._channels.values():
            for future in channel.pending.values():
                if not future.done():
                    future.set_exception(ConnectionClosed(str(err)) if not isinstance(
                        err, (ConnectionClosed, ProtocolError)) else err)
            channel.pending.clear()

    def _dispatch(self, conn_id: int, channel: _Channel, message: Message) -> None:
        if message.kind == MessageType.RESPONSE:
            future = channel.pending.pop(message.stream_id, None)
            if future is None or future.done():
                log.warning("nri_ttrpc_unexpected_response", conn=conn_id,
                            stream=message.stream_id)
                return
            if message.data is None:
                future.set_exception(RemoteError(Code.RESOURCE_EXHAUSTED,
                                                 f"response of {message.length} bytes"))
                return
            future.set_result(message.data)
        elif message.kind == MessageType.REQUEST:
            if message.stream_id % 2 == 0:
                raise ProtocolError(f"request on even stream {message.stream_id} "
                                    f"(connection {conn_id})")
            task = asyncio.create_task(self._serve(conn_id, message))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        else:
            # NRI makes unary calls only: stream data has no one to go to.
            log.warning("nri_ttrpc_unexpected_message", conn=conn_id,
                        stream=message.stream_id, kind=message.kind)

    async def _serve(self, conn_id: int, message: Message) -> None:
        response = request_pb2.Response()
        if message.data is None:
            response.status.code = Code.RESOURCE_EXHAUSTED
            response.status.message = (f"message length {message.length} exceed maximum "
                                       f"message size of {MESSAGE_LENGTH_MAX}")
        else:
            request = request_pb2.Request()
            try:
                request.ParseFromString(message.data)
            except Exception as err:  # noqa: BLE001 - a decode error of any kind
                response.status.code = Code.INVALID_ARGUMENT
                response.status.message = f"undecodable ttrpc request: {err}"
            else:
                handler = self._services.get(conn_id, {}).get((request.service, request.method))
                if handler is None:
                    known = {s for s, _ in self._services.get(conn_id, {})}
                    response.status.code = Code.UNIMPLEMENTED
                    response.status.message = (f"method {request.method}"
                                               if request.service in known
                                               else f"service {request.service}")
                else:
                    try:
                        response.payload = await handler(request.payload)
                    except RemoteError as err:
                        response.status.code = err.code
                        response.status.message = err.message
                    except Exception as err:  # noqa: BLE001 - answered, never raised
                        log.exception("nri_ttrpc_handler_failed", service=request.service,
                                      method=request.method)
                        response.status.code = Code.UNKNOWN
                        response.status.message = str(err) or type(err).__name__
        try:
            await self._send(conn_id, encode_message(message.stream_id, MessageType.RESPONSE,
                                                     response.SerializeToString()))
        except (ConnectionClosed, OSError) as err:
            # The runtime went away while we worked; the next session re-syncs.
            log.info("nri_ttrpc_answer_lost", conn=conn_id, stream=message.stream_id,
                     error=str(err))

    async def _send(self, conn_id: int, message: bytes) -> None:
        if self._closed.is_set():
            raise ConnectionClosed("NRI connection closed")
        # One write call per message: asyncio never interleaves two writes' bytes.
        self._writer.write(encode_mux(conn_id, message))
        await self._writer.drain()

    async def call(self, conn_id: int, service: str, method: str, payload: bytes,
                   timeout: float) -> bytes:
        """A unary call; the answer's payload bytes, or RemoteError with its status."""
        if self._error is not None:
            raise ConnectionClosed(str(self._error))
        channel = self._channel(conn_id)
        stream_id = channel.next_stream
        channel.next_stream += 2
        request = request_pb2.Request(service=service, method=method, payload=payload,
                                      timeout_nano=int(timeout * 1e9))
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        channel.pending[stream_id] = future
        try:
            await self._send(conn_id, encode_message(stream_id, MessageType.REQUEST,
                                                     request.SerializeToString()))
            data = await within(future, timeout)
        finally:
            channel.pending.pop(stream_id, None)
        response = request_pb2.Response()
        response.ParseFromString(data)
        if response.status.code != Code.OK:
            raise RemoteError(response.status.code, response.status.message)
        return response.payload

    async def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._fail(ConnectionClosed("NRI connection closed"))
        for task in list(self._handlers):
            task.cancel()
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (OSError, ConnectionError):
            pass
