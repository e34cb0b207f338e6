"""The NVIDIA command-line tools a mock node has, for the parts the driver uses.

`nvidia-smi compute-policy -i <uuid> --set-timeslice <n>` changes the GPU's time slice in
the state the fake NVML library reads (driver/devices/mock/gpustate.py).

`nvidia-cuda-mps-control` behaves like the real one as far as the driver can see: `-d`
(background) or `-f` (foreground) starts a control daemon that listens on
`$CUDA_MPS_PIPE_DIRECTORY/control`, writes `nvidia-cuda-mps-control.pid` beside it and logs
to `$CUDA_MPS_LOG_DIRECTORY/control.log`; a second daemon on the same pipe directory
refuses to start; `-M` beside `-d`/`-f` is multi-user mode (one root server for every UID's
clients, Volta or newer; the mock logs the mode, having no clients to serve); anything else
is a usage error; without options it is the control client, reading commands from stdin
(`get_server_list`, `set_default_active_thread_percentage`, `quit`, ...). There are no CUDA
clients on a mock node, so no MPS server is ever spawned.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
from pathlib import Path

from driver.devices.mock.gpustate import GpuStateStore

# Which Python runs the tools: the driver process that runs one sets it to its own
# interpreter. The mock tree's scripts cannot name it: the host's driver and the MPS
# daemon pod (the image's /opt/dra) run the same scripts from the same tree.
PYTHON_VARIABLE = "DRA_MOCK_PYTHON"
CONTROL = "control"
PID_FILE = "nvidia-cuda-mps-control.pid"
TIMESLICES = (0, 1, 2, 3)


def nvidia_smi(root: Path, args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nvidia-smi compute-policy")
    parser.add_argument("-i", "--id", required=True)
    parser.add_argument("--set-timeslice", type=int, required=True)
    options = parser.parse_args(args)
    if options.set_timeslice not in TIMESLICES:
        print(f"Invalid timeslice value {options.set_timeslice}", file=sys.stderr)
        return 2
    known = {line.split(":", 1)[1].strip()
             for info in (root / "proc" / "driver" / "nvidia" / "gpus").glob("*/information")
             for line in info.read_text().splitlines() if line.startswith("GPU UUID:")}
    if options.id not in known:
        print(f"No devices were found matching {options.id}", file=sys.stderr)
        return 6
    GpuStateStore(root).update(options.id, timeslice=options.set_timeslice)
    print(f"Set timeslice to {options.set_timeslice} for GPU {options.id}")
    return 0


def _directories() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    log = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    return pipe, log


def _connect(pipe: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(pipe / CONTROL))
        return sock
    except OSError:
        sock.close()
        return None


class _Daemon:
    def __init__(self, pipe: Path, log: Path, multi_user: bool = False) -> None:
        self.pipe, self.log_dir = pipe, log
        self.multi_user = multi_user
        self.active_threads = 100.0
        self.pinned: dict[str, str] = {}
        self.running = True

    def log(self, message: str) -> None:
        with open(self.log_dir / "control.log", "a") as out:
            out.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}\n")

    def answer(self, command: str) -> str:
        words = command.split()
        if not words:
            return ""
        name, args = words[0], words[1:]
        if name == "quit":
            self.running = False
            return ""
        if name == "get_server_list":
            return ""
        if name == "set_default_active_thread_percentage" and len(args) == 1:
            self.active_threads = float(args[0])
            return f"{self.active_threads:g}"
        if name == "get_default_active_thread_percentage":
            return f"{self.active_threads:.1f}"
        if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
            self.pinned[args[0]] = args[1]
            return ""
        if name == "get_default_device_pinned_mem_limit" and len(args) == 1:
            return self.pinned.get(args[0], "0")
        return f"Unrecognized command {command!r}"

    def serve(self) -> int:
        self.pipe.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        live = _connect(self.pipe)
        if live is not None:
            live.close()
            print("An instance of this daemon is already running", file=sys.stderr)
            return 1
        (self.pipe / CONTROL).unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.pipe / CONTROL))
        server.listen(16)
        server.settimeout(0.5)
        (self.pipe / PID_FILE).write_text(f"{os.getpid()}\n")
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "running", False))
        self.log(f"Control daemon started, CUDA_VISIBLE_DEVICES="
                 f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}, CUDA_MPS_PIPE_DIRECTORY="
                 f"{self.pipe}, multi-user mode {'on' if self.multi_user else 'off'}")
        try:
            while self.running:
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                except InterruptedError:
                    continue
                with conn:  # a client may connect and leave (a liveness probe): no error
                    try:
                        command = conn.makefile().readline().strip()
                        if command:
                            self.log(f"Received command: {command}")
                            conn.sendall((self.answer(command) + "\n").encode())
                    except OSError:
                        continue
        finally:
            server.close()
            (self.pipe / CONTROL).unlink(missing_ok=True)
            (self.pipe / PID_FILE).unlink(missing_ok=True)
            self.log("Exit")
        return 0


def mps_control(args: list[str]) -> int:
    pipe, log = _directories()
    # -M (multi-user): one MPS server, run as root, for the clients of every UID; it is an
    # option of the daemon, so it goes with -d or -f, in either order.
    mode = [a for a in args if a != "-M"]
    multi_user = len(mode) < len(args)
    if mode in (["-d"], ["-f"]) and len(args) <= 2:
        if mode == ["-d"] and os.fork():
            return 0  # the parent returns at once, as the real -d does
        if mode == ["-d"]:
            os.setsid()
        return _Daemon(pipe, log, multi_user).serve()
    if args:
        print("Usage: nvidia-cuda-mps-control [-d | -f] [-M]", file=sys.stderr)
        return 1
    status = 0
    for line in sys.stdin:
        command = line.strip()
        if not command:
            continue
        sock = _connect(pipe)
        if sock is None:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        with sock:
            sock.sendall((command + "\n").encode())
            reply = sock.makefile().readline().rstrip("\n")
        if reply:
            print(reply)
        if reply.startswith("Unrecognized"):
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--root":
        print("usage: tools --root MOCK_ROOT (nvidia-smi ARGS | nvidia-cuda-mps-control ARGS)",
              file=sys.stderr)
        return 2
    root, tool, rest = Path(argv[1]), argv[2], argv[3:]
    if tool == "nvidia-smi" and rest[:1] == ["compute-policy"]:
        return nvidia_smi(root, rest[1:])
    if tool == "nvidia-cuda-mps-control":
        return mps_control(rest)
    print(f"mock {tool}: unsupported arguments {rest}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
