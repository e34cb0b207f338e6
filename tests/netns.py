"""Run a command in a network namespace of its own, as a pod without hostNetwork runs.

Two driver pods of a seamless upgrade each have their own network namespace, so both bind
the default ports 9400/9401; they share only the host directories. To run them that way on
one machine, each is started as

    unshare --net python -m tests.netns --tcp-to-unix PORT=PATH --unix-to-tcp PATH=PORT -- CMD

which brings up loopback in the new namespace and bridges through unix sockets (paths
work across network namespaces): `--tcp-to-unix` lets the command reach the API emulator
at 127.0.0.1:PORT as if it were local, `--unix-to-tcp` lets the test reach the command's
probe and metrics ports. SIGTERM and SIGINT are passed on; the command dies with us.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import http.client
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def available() -> str | None:
    """None when `unshare --net` works here, else why not (for a skip reason)."""
    try:
        done = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unshare --net cannot run: {err}"
    if done.returncode != 0:
        return f"unshare --net fails: {done.stderr.decode().strip()}"
    return None


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class Forwarder:
    """Accepts on one address and connects each client through to another."""

    def __init__(self, listen: socket.socket, connect) -> None:
        self.listen = listen
        self.connect = connect  # () -> connected socket
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listen.accept()
            except OSError:
                return
            try:
                upstream = self.connect()
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def unix_listener(path: str) -> socket.socket:
    Path(path).unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    return sock


def tcp_listener(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    return sock


def to_unix(path: str):
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return sock
    return connect


def to_tcp(port: int):
    return lambda: socket.create_connection(("127.0.0.1", port), timeout=10)


def http_get(unix_path: Path, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """GET over a unix socket bridged to a port inside a namespace."""

    class Connection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(str(unix_path))

    conn = Connection("localhost", timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tcp-to-unix", action="append", default=[], metavar="PORT=PATH")
    parser.add_argument("--unix-to-tcp", action="append", default=[], metavar="PATH=PORT")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    loopback_up()
    for spec in args.tcp_to_unix:
        port, path = spec.split("=", 1)
        Forwarder(tcp_listener(int(port)), to_unix(path))
    for spec in args.unix_to_tcp:
        path, port = spec.split("=", 1)
        Forwarder(unix_listener(path), to_tcp(int(port)))
    child = subprocess.Popen(command, preexec_fn=_die_with_parent)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _f: child.send_signal(s))
    while True:
        try:
            return child.wait()
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for clarity
            continue


if __name__ == "__main__":
    sys.exit(main())
