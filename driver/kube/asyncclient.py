"""GETs to the API server from the event loop: the claim reads of Prepare.

A batch of claims is read all at once. As blocking urllib3 calls (driver/kube/client.py) each
GET took a claim worker thread, and with 32 of them in flight every socket call handed
the interpreter lock to another thread: half of the driver's CPU in a batch was that
lock's futex traffic (bench/RESULTS.md). Here the GETs are requests on the event loop,
multiplexed over a few keep-alive connections, and a claim takes a thread only for its
local writes.

What it speaks is deliberately small: HTTP/1.1 GET for a JSON answer, sent as a body of
known length or chunked (as Go's net/http, and so the API server, sends anything over a
few KiB), over plain TCP or TLS with the client's own settings (CA, client certificate,
tls-server-name, insecure). A configuration with a proxy is left to the threaded client,
which speaks to proxies. Answers and errors read exactly as driver/kube/client.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any

from driver.kube.client import USER_AGENT, ApiError, Kube, answer

# Larger answers are refused rather than buffered: a claim is at most a few hundred KiB
# (the API server's request limit is 3 MiB).
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_HEADER_LINES = 128
# A kept-alive connection older than this is closed rather than reused: Go's client
# gives up an idle connection after 90 s, and servers and load balancers behind it
# expect no more.
IDLE_SECONDS = 90.0


class _Dropped(Exception):
    """The connection ended before the status line: a GET on it may go once more."""


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float

    def close(self) -> None:
        self.writer.close()


class LoopGets:
    """GETs of JSON on the event loop, at most `connections` at a time (each on a
    connection of its own, kept alive for the next)."""

    def __init__(self, kube: Kube, connections: int) -> None:
        self.kube = kube
        self.connections = max(1, connections)
        # Connections and the semaphore belong to one event loop; a caller on another
        # loop (the driver has one; tests run several) starts afresh.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots = asyncio.Semaphore(self.connections)
        self._idle: list[_Connection] = []

    def _on_this_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self._loop is not None and not self._loop.is_closed():
                self.close()
            self._loop, self._idle = loop, []
            self._slots = asyncio.Semaphore(self.connections)

    async def get(self, path: str) -> Any:
        """The decoded JSON answer to GET `path`; ApiError (NotFound for a 404) otherwise,
        with the messages of Kube.request."""
        client = self.kube.client
        if client is None:  # made once, in a thread: it may read files or run a plugin
            client = await asyncio.to_thread(self.kube.ensure_client, "GET", path)
        if client.config.proxy:
            return await asyncio.to_thread(self.kube.request, "GET", path)
        headers = (await asyncio.to_thread(client.config.headers)
                   if client.config.headers_may_block else client.config.headers())
        request = _request(path, client.config.server, headers)
        timeout = self.kube.timeout
        self._on_this_loop()
        async with self._slots:
            task = asyncio.ensure_future(self._exchange(request, client, timeout))
            try:
                # asyncio.wait, not wait_for: see driver/aio.py.
                done, _ = await asyncio.wait((task,), timeout=timeout)
            finally:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if not done:
                raise ApiError(0, f"GET {path}: no answer within {timeout:g} s")
            try:
                status, reason, body = task.result()
            except (OSError, EOFError, ValueError, _Dropped) as err:
                raise ApiError(0, f"GET {path}: {_reason(err)}") from err
        return answer("GET", path, status, reason, body)

    async def _exchange(self, request: bytes, client, timeout: float) -> tuple[int, str, bytes]:
        # A server or proxy may close a connection just as a request goes out on it (an
        # idle one it timed out, a restart): a GET goes once more, on a new connection,
        # as client-go's does. Whether a write arrived would be unknown; GETs only here.
        connection = self._reuse() or await _connect(client, timeout)
        try:
            return await self._on(connection, request)
        except (_Dropped, ConnectionResetError, BrokenPipeError):
            pass
        return await self._on(await _connect(client, timeout), request)

    def _reuse(self) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        while self._idle:
            connection = self._idle.pop()
            if now - connection.idle_since < IDLE_SECONDS and not connection.reader.at_eof():
                return connection
            connection.close()
        return None

    async def _on(self, connection: _Connection, request: bytes) -> tuple[int, str, bytes]:
        """One request and its whole answer; the connection goes back to the pool only
        then, and is closed on anything else (a cancel included)."""
        reusable = False
        try:
            connection.writer.write(request)
            status, reason, body, reusable = await _response(connection.reader)
            return status, reason, body
        finally:
            if reusable:
                connection.idle_since = asyncio.get_running_loop().time()
                self._idle.append(connection)
            else:
                connection.close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()


def _request(path: str, server: str, headers: dict[str, str]) -> bytes:
    host = urllib.parse.urlsplit(server).netloc
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", f"User-Agent: {USER_AGENT}",
             "Accept: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _connect(client, timeout: float) -> _Connection:
    url = urllib.parse.urlsplit(client.config.server)
    secure = url.scheme == "https"
    port = url.port or (443 if secure else 80)
    options: dict[str, Any] = {}
    if secure:
        options = {"ssl": client.tls_context, "ssl_handshake_timeout": timeout,
                   "server_hostname": client.config.tls_server_name or url.hostname}
    # The default line limit (64 KiB) bounds a header line and a chunk size line.
    reader, writer = await asyncio.open_connection(url.hostname, port, **options)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # a request is one write; nothing to coalesce
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _Connection(reader, writer, 0.0)


async def _response(reader: asyncio.StreamReader) -> tuple[int, str, bytes, bool]:
    """(status, reason, body, whether the connection may serve another request)."""
    while True:
        line = await reader.readline()
        if not line:
            raise _Dropped("the server closed the connection without an answer")
        version, status, reason = _status_line(line)
        headers = await _headers(reader)
        if not 100 <= status < 200:
            break  # a 1xx is followed by the real answer
    encoding = headers.get("transfer-encoding", "").lower()
    close = "close" in headers.get("connection", "").lower() or (
        version == "HTTP/1.0" and "keep-alive" not in headers.get("connection", "").lower())
    if encoding:
        if encoding != "chunked":
            raise ValueError(f"unsupported Transfer-Encoding {encoding!r}")
        body = await _chunked(reader)
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise ValueError(f"bad Content-Length {headers['content-length']!r}") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise ValueError(f"an answer of {length} bytes (at most {MAX_BODY_BYTES} are read)")
        body = await reader.readexactly(length)
    elif status in (204, 304):
        body = b""
    else:  # neither: the body ends with the connection
        body = await reader.read(MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            raise ValueError(f"an answer over {MAX_BODY_BYTES} bytes")
        close = True
    if headers.get("content-encoding", "identity").lower() != "identity":
        # Not asked for (no Accept-Encoding is sent), so not decoded.
        raise ValueError(f"an answer in Content-Encoding {headers['content-encoding']!r}")
    return status, reason, body, not close


def _status_line(line: bytes) -> tuple[str, int, str]:
    parts = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP answer: {line[:80]!r}")
    return parts[0], int(parts[1]), parts[2] if len(parts) > 2 else ""


async def _headers(reader: asyncio.StreamReader) -> dict[str, str]:
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        line = await reader.readline()
        if line in (b"\r\n", b"\n"):
            return headers
        if not line.endswith(b"\n"):
            raise EOFError("the connection ended in the answer's headers")
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep:
            raise ValueError(f"not an HTTP header: {line[:80]!r}")
        key = name.strip().lower()
        value = value.strip()
        # Repeated headers join with commas (RFC 9110), except that two different
        # lengths are an answer no one can read safely.
        if key == "content-length" and key in headers and headers[key] != value:
            raise ValueError("two different Content-Length headers")
        headers[key] = f"{headers[key]}, {value}" if key in headers and key != "content-length" else value
    raise ValueError(f"more than {MAX_HEADER_LINES} header lines")


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    size = 0
    while True:
        line = await reader.readline()
        if not line.endswith(b"\n"):
            raise EOFError("the connection ended in a chunked answer")
        try:
            length = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise ValueError(f"bad chunk size line {line[:40]!r}") from None
        if length < 0:
            raise ValueError(f"bad chunk size line {line[:40]!r}")
        if length == 0:
            await _headers(reader)  # trailers, up to the empty line
            return b"".join(parts)
        size += length
        if size > MAX_BODY_BYTES:
            raise ValueError(f"an answer over {MAX_BODY_BYTES} bytes")
        parts.append(await reader.readexactly(length))
        if await reader.readexactly(2) != b"\r\n":
            raise ValueError("a chunk not followed by CRLF")


def _reason(err: BaseException) -> str:
    if isinstance(err, asyncio.IncompleteReadError):
        return "the connection ended in the middle of the answer"
    if isinstance(err, ssl.SSLError):
        return f"TLS: {err}"
    return str(err) or type(err).__name__
