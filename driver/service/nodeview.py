"""`dra-driver status`: this node's devices, who holds them and what they are doing, read
from the state directory and NVML/sysfs, without the API server (works while the API
server is down, and beside a running driver, whose files it only reads).

Sources: the claim records (`<state>/claims/`), the idle timers
(`<state>/utilization/idle.json`), the health conditions the running driver writes on
every change (`<state>/utilization/health.json`), and one fresh sample of every device.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from driver.state import atomic

from driver.publish import extendedresources
from driver.state.checkpoint import ClaimRecord, State, read_records
from driver.service import support
from driver.service.config import Config
from driver.devices import mock
from driver.devices.discovery import discover
from driver.devices.model import Inventory
from driver.service.node import NodeRoots, open_node
from driver.monitoring.utilization import idle
from driver.monitoring.utilization.monitor import MIB, duration, holders_of
from driver.monitoring.utilization.sampler import Sampler

HEALTH_FILE = Path("utilization") / "health.json"


def write_health(state_dir: Path, owner: str, health: Any) -> None:
    """Called on every health change (rare); a failure only makes `status` older."""
    try:
        atomic.write(state_dir / HEALTH_FILE, json.dumps(health.snapshot(), sort_keys=True).encode(),
                     owner=owner, durable=False)
    except OSError:
        pass


@dataclass(frozen=True)
class Row:
    device: str
    kind: str
    health: str  # "Healthy", or the condition reasons
    claim: str  # namespace/name, "" when free
    claim_uid: str
    pods: tuple[str, ...]  # as reserved when the claim was last prepared
    share: str
    admin_access: bool
    utilization_percent: float | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    power_watts: float | None
    processes: int | None
    idle_seconds: float | None  # None: not judged (free, admin access, not a GPU)
    rx_bytes: int | None
    tx_bytes: int | None


def _records(state_dir: Path, problems: list[str]) -> list[ClaimRecord]:
    found = read_records(state_dir / "claims", problems)
    return [found[uid] for uid in sorted(found) if found[uid].state is State.PREPARE_COMPLETED]


def _node(config: Config, scratch: Path) -> NodeRoots:
    if config.mock is None:
        return open_node(config)
    # The running driver's mock tree, read as it is (building one would pull the files
    # from under it); a fresh one when no driver runs.
    attached = mock.attach(config.mock, config.state_dir / "mock")
    if attached is None:
        return open_node(config, scratch / "mock")
    return NodeRoots.of_mock(attached)


def collect(config: Config, problems: list[str] | None = None) -> list[Row]:
    problems = [] if problems is None else problems
    if not config.state_dir.is_dir():
        problems.append(f"no driver state at {config.state_dir} (--state-dir): no claims shown")
    with tempfile.TemporaryDirectory(prefix="dra-status-") as scratch:
        node = _node(config, Path(scratch))
        inventory = discover(node.sources(config)).inventory
        sampler = Sampler(node.nvml, node.sysfs, lambda: inventory)
        try:
            samples = sampler.sample()
        finally:
            sampler.close()
    return rows(inventory, samples, holders_of(_records(config.state_dir, problems)),
                {idle.p_key(p): p for p in idle.load(config.state_dir / idle.FILE)},
                _health(config.state_dir), time.time())


def _health(state_dir: Path) -> dict[str, list[dict]]:
    try:
        data = json.loads((state_dir / HEALTH_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def rows(inventory: Inventory, samples: dict, held: dict, periods: dict, health: dict,
         now: float) -> list[Row]:
    out = []
    for device in inventory.devices:
        sample = samples.get(device.name)
        conditions = health.get(device.name) or []
        state = ",".join(str(c.get("reason")) for c in conditions) if conditions else "Healthy"
        for holder in held.get(device.name) or [None]:
            judged = holder is not None and not holder.admin and device.kind.value in ("gpu", "mig")
            period = periods.get((device.name, holder.uid)) if holder is not None else None
            # An idle timer the driver has not started yet (it samples every interval) is
            # shown from this sample, so a fresh claim on an idle GPU reads 0s, not "-".
            idle_seconds = None
            if judged:
                idle_seconds = max(0.0, now - period.since) if period is not None else 0.0
            out.append(Row(
                device.name, device.kind.value, state,
                f"{holder.namespace}/{holder.name}" if holder else "", holder.uid if holder else "",
                holder.pods if holder else (),
                (holder.share or "") if holder else "", bool(holder and holder.admin),
                round(sample.utilization * 100, 1) if sample and sample.utilization is not None else None,
                sample.memory_used // MIB if sample and sample.memory_used is not None else None,
                sample.memory_total // MIB if sample and sample.memory_total is not None else None,
                round(sample.power_watts, 1) if sample and sample.power_watts is not None else None,
                sample.processes if sample else None, idle_seconds,
                sample.rx_bytes if sample else None, sample.tx_bytes if sample else None))
    return out


def _cell(value: Any, unit: str = "") -> str:
    return "-" if value is None or value == "" else f"{value}{unit}"


def table(found: list[Row]) -> str:
    # KERNEL: the share of time a kernel ran (NVML's GPU utilization), not SM activity.
    header = ("DEVICE", "KIND", "HEALTH", "CLAIM", "PODS", "SHARE", "KERNEL", "MEMORY", "POWER", "PROCS",
              "IDLE")
    lines = [header]
    for r in found:
        memory = (f"{r.memory_used_mib}/{r.memory_total_mib}Mi" if r.memory_total_mib is not None
                  else (f"rx {r.rx_bytes} tx {r.tx_bytes}" if r.rx_bytes is not None else "-"))
        claim = (r.claim + " (admin)") if r.admin_access else r.claim
        pods = ",".join(r.pods[:2]) + (f",+{len(r.pods) - 2}" if len(r.pods) > 2 else "")
        lines.append((r.device, r.kind, r.health, _cell(claim), _cell(pods), _cell(r.share[:8]),
                      _cell(r.utilization_percent, "%"), memory, _cell(r.power_watts, "W"),
                      _cell(r.processes),
                      duration(r.idle_seconds) if r.idle_seconds is not None else "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() + "\n"
                   for line in lines)


def main(config: Config, output: str) -> int:
    problems: list[str] = []
    found = collect(config, problems)
    # What the running driver found at its start (driver/publish/extendedresources.py).
    problems += [t.message(config.node_name) for t in extendedresources.recorded(config.state_dir)]
    for problem in problems:
        print(f"dra-driver status: {problem}", file=sys.stderr)
    # What the running driver said at start of its cluster's release (driver/service/support.py).
    cluster = (support.recorded(config.state_dir) or {}).get("line")
    if output == "json":
        rows = [{**asdict(r), "cluster_support": cluster} for r in found]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    elif not found:
        # A header over nothing reads as "status is broken"; say what was looked at instead,
        # as kubectl says "No resources found".
        where = f"--mock {config.mock.name}" if config.mock else f"--sysfs-root {config.sysfs_root}"
        print(f"dra-driver status: no GPU, FPGA or NIC found on node {config.node_name} ({where}); "
              "`dra-driver discover` lists what it sees and what it left out", file=sys.stderr)
    else:
        sys.stdout.write((f"{cluster}\n" if cluster else "") + table(found))
    return 0
