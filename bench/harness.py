"""What every measurement drives: a real driver process in mock mode against the API
server emulator (`Driver`), the claims it prepares, and waiting for quiet."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from driver.sim.apiserver import ApiServer, claim_allocated
from driver.sim.kubelet import Claim, FakeKubelet

DRIVER = "accel.dra.io"
NODE = "bench-node"
GPU = "gpu-0000-11-00-0"


def file_system(path: Path) -> str:
    """The file system `path` is on, as far as a prepare's cost goes: its type, and for
    ext4 whether it has a journal. Without one (this development VM's root) the kernel
    skips recently deleted inodes when it allocates one (fs/ext4/ialloc.c,
    recently_deleted), so creating a file costs more with every file deleted in the
    last minutes; nodes run ext4 with a journal, or xfs."""
    best, fstype, source = "", "unknown", ""
    try:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            point = left.split()[4]
            if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, (fstype, source) = point, right.split()[:2]
    except (OSError, ValueError, IndexError):
        return "unknown"
    if fstype != "ext4":
        return fstype
    device = os.path.basename(source)
    journaled = any(e.startswith(f"{device}-") for e in os.listdir("/proc/fs/jbd2")) \
        if os.path.isdir("/proc/fs/jbd2") else None
    return {True: "ext4 with a journal", False: "ext4 WITHOUT a journal"}.get(journaled, "ext4")

def settle(api: ApiServer, quiet: float = 0.5, limit: float = 15.0) -> None:
    """Wait until the API server has had no request for `quiet` seconds: the claim status
    writes of the last phase (0.2 s after each prepare and unprepare) must not run inside
    the next phase's measurement."""
    deadline = time.monotonic() + limit
    seen = api.state.requests
    calm_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if api.state.requests != seen:
            seen, calm_since = api.state.requests, time.monotonic()
        elif time.monotonic() - calm_since >= quiet:
            return

def wait(predicate, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return False

class Driver:
    def __init__(self, api: ApiServer, profile: str, extra: list[str] | None = None,
                 env: dict[str, str] | None = None, checkout: Path | None = None,
                 node: str = NODE) -> None:
        """`checkout`: run the driver of that source tree (an A/B against another commit)."""
        self.dir = Path(tempfile.mkdtemp(prefix="dra-bench-"))
        self.api = api
        self.env = env
        self.checkout = checkout
        if checkout is not None:
            self.env = {**(env or os.environ), "PYTHONPATH": str(checkout)}
        self.args = [sys.executable, "-m", "driver", "run", "--node-name", node, "--driver-name", DRIVER,
                     "--mock", profile, "--kubeconfig", str(api.kubeconfig(self.dir)),
                     "--kubelet-registrar-dir", str(self.dir / "registry"),
                     "--kubelet-plugins-dir", str(self.dir / "plugins"), "--cdi-root", str(self.dir / "cdi"),
                     "--state-dir", str(self.dir / "state"), "--metrics-port", "0", "--healthz-port", "0",
                     "--log-level", "warning", *(extra or [])]

    def start(self) -> float:
        started = time.perf_counter()
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=open(self.dir / "log", "wb"),
                                     env=self.env, cwd=self.checkout)
        self.started = started
        return started

    def kubelet(self) -> FakeKubelet:
        kubelet = FakeKubelet(self.dir / "registry")
        kubelet.register(timeout=60)
        return kubelet

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)

def with_bytecode(scratch: Path) -> dict[str, str]:
    """The environment of a driver process that reads and writes bytecode, as the image's
    (pip compiles at install), in a cache of the bench's own: this machine sets
    PYTHONDONTWRITEBYTECODE and the package is installed editable, so each start would
    otherwise compile the driver's modules again."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    return env

def new_claim(api: ApiServer, device: str = GPU, node: str = NODE) -> Claim:
    """A claim for the mixed node's first GPU. Many of them are prepared at once below, so
    they hold it with admin access: the exclusivity check lets such claims sit side by
    side, and the prepare path is otherwise the same."""
    uid = str(uuid.uuid4())
    name = f"c-{uid[:8]}"
    api.put_claim(claim_allocated("default", name, uid, [
        {"request": "r", "driver": DRIVER, "pool": node, "device": device, "adminAccess": True}]))
    return Claim("default", name, uid)

def share_claim(api: ApiServer, device: str, memory: str, compute: str) -> Claim:
    uid = str(uuid.uuid4())
    name = f"s-{uid[:8]}"
    api.put_claim(claim_allocated("default", name, uid, [
        {"request": "r", "driver": DRIVER, "pool": NODE, "device": device, "shareID": str(uuid.uuid4()),
         "consumedCapacity": {"memory": memory, "compute": compute}}]))
    return Claim("default", name, uid)
