"""Liveness and readiness over HTTP (/livez, /readyz; /healthz = /livez).

live:  the event loop ran a heartbeat within the last few seconds (a blocked loop is dead).
ready: the kubelet accepted our registration and the first publish is done.
The HTTP server runs in its own thread so that it can answer while the loop is blocked.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client.exposition import CONTENT_TYPE_LATEST

HEARTBEAT_SECONDS = 0.5
STALE_SECONDS = 5.0


@dataclass
class Probes:
    ready: Callable[[], tuple[bool, str]]
    stale_after: float = STALE_SECONDS
    last_beat: float = field(default_factory=time.monotonic)

    async def heartbeat(self) -> None:
        while True:
            self.last_beat = time.monotonic()
            await asyncio.sleep(HEARTBEAT_SECONDS)

    def live(self) -> tuple[bool, str]:
        age = time.monotonic() - self.last_beat
        return (age < self.stale_after, f"event loop heartbeat {age:.1f}s ago")


class HttpEndpoint:
    """One small HTTP server: probes and/or metrics, on 127.0.0.1 or all interfaces."""

    def __init__(self, port: int, probes: Probes | None = None,
                 metrics: Callable[[], bytes] | None = None, host: str = "0.0.0.0") -> None:
        routes: dict[str, Callable[[], tuple[int, bytes, str]]] = {}
        if probes is not None:
            def check(fn):
                ok, why = fn()
                return (200 if ok else 503), f"{'ok' if ok else 'not ok'}: {why}\n".encode(), "text/plain"
            routes["/livez"] = routes["/healthz"] = lambda: check(probes.live)
            routes["/readyz"] = lambda: check(probes.ready)
        if metrics is not None:
            routes["/metrics"] = lambda: (200, metrics(), CONTENT_TYPE_LATEST)

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                status, body, ctype = route() if route else (404, b"not found\n", "text/plain")
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name=f"http-{port}")

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> "HttpEndpoint":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
