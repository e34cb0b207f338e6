"""`dra-driver demo`: the whole driver on this machine, no cluster, no hardware.

Starts the API server emulator, runs `dra-driver run --mock <profile>` as a real process,
registers it with a fake kubelet, allocates claims like the examples' with the DeviceClass
and claim CEL selectors, prepares them over the kubelet's gRPC protocol, starts a podman
container with the returned CDI devices where podman can run (root, podman, runc,
busybox-static), prints what the container saw, then unprepares and stops.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

from driver import deviceclasses
from driver.devices.model import Device, DeviceKind, Inventory
from driver.opaque import API_VERSION

CLAIMS = [
    ("gpu-nic-aligned", "a GPU and an RDMA NIC on the same PCIe root", {
        "devices": {
            "requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu.{driver}"}},
                {"name": "nic", "exactly": {"deviceClassName": "nic.{driver}", "selectors": [
                    {"cel": {"expression": 'device.attributes["{driver}"].rdma == true'}}]}},
            ],
            "constraints": [{"requests": ["gpu", "nic"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}],
        }}),
    ("fpga-by-shell", "an FPGA whose shell matches the bitstream (Alveo U250)", {
        "devices": {"requests": [{"name": "fpga", "exactly": {"deviceClassName": "fpga.{driver}", "selectors": [
            {"cel": {"expression": 'device.attributes["{driver}"].interfaceID == "1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d"'}}]}}]}}),
    ("sriov-vf-rdma", "an SR-IOV VF with RDMA", {
        "devices": {
            "requests": [{"name": "vf", "exactly": {"deviceClassName": "nic.{driver}", "selectors": [
                {"cel": {"expression": 'device.attributes["{driver}"].sriovVF == true && device.attributes["{driver}"].rdma == true'}}]}}],
            "config": [{"requests": ["vf"], "opaque": {"driver": "{driver}", "parameters": {
                "apiVersion": API_VERSION, "kind": "NicConfig", "env": {"NCCL_IB_HCA": "auto"}}}}],
        }}),
]


def _fill(obj, driver: str):
    if isinstance(obj, str):
        return obj.replace("{driver}", driver)
    if isinstance(obj, list):
        return [_fill(x, driver) for x in obj]
    if isinstance(obj, dict):
        return {k: _fill(v, driver) for k, v in obj.items()}
    return obj


def podman_ready() -> str | None:
    """None when a container can be started here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} not installed"
    if not Path("/bin/busybox").exists():
        return "busybox-static not installed"
    return None


def run_container(rootfs: Path, cdi_ids: list[str], script: str) -> subprocess.CompletedProcess:
    args = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs", "run", "--rm", "--network", "none",
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
    for cdi_id in cdi_ids:
        args += ["--device", cdi_id]
    return subprocess.run(args + ["--rootfs", str(rootfs), "/bin/sh", "-c", script],
                          capture_output=True, text=True, timeout=120)


def busybox_rootfs(directory: Path) -> Path:
    root = directory / "rootfs"
    for sub in ("bin", "dev", "proc", "sys", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "env", "ls", "grep", "sort", "stat"):
        (root / "bin" / applet).symlink_to("busybox")
    return root


def main(profile: str = "mixed", driver: str = "accel.dra.io", out: Callable[[str], None] = print) -> int:
    try:
        from driver.sim.allocator import allocate, allocation_config, allocation_results
    except ImportError as err:
        out(f"the demo needs the [demo] extra (cel-python): pip install '.[demo]' ({err})")
        return 2
    from driver.sim.apiserver import ApiServer, claim_allocated
    from driver.sim.kubelet import Claim, FakeKubelet

    node = "demo-node"
    work = Path(tempfile.mkdtemp(prefix="dra-demo-", dir="/tmp"))
    why_not = podman_ready()
    cdi_root = Path("/var/run/cdi") if why_not is None else work / "cdi"
    log_file = work / "driver.log"
    proc = None
    with ApiServer() as api:
        api.add_node(node)
        try:
            out(f"== API server emulator at {api.url}; driver state in {work}")
            args = [sys.executable, "-m", "driver", "run", "--node-name", node, "--driver-name", driver,
                    "--mock", profile, "--kubeconfig", str(api.kubeconfig(work)),
                    "--kubelet-registrar-dir", str(work / "registry"),
                    "--kubelet-plugins-dir", str(work / "plugins"), "--cdi-root", str(cdi_root),
                    "--state-dir", str(work / "state"), "--metrics-port", "0", "--healthz-port", "0",
                    "--log-format", "json"]
            with open(log_file, "wb") as log:
                proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
            kubelet = FakeKubelet(work / "registry")
            info = kubelet.register()
            out(f"== kubelet: registered {info.name} ({', '.join(info.supported_versions)}), "
                f"talking {kubelet.version}")
            deadline = time.monotonic() + 20
            while not api.state.slices and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            stored = api.slices()
            inventory = _inventory_from_slices(stored, driver)
            out(f"== published {len(inventory.devices)} devices in {len(stored)} ResourceSlices "
                f"(pool {node}, generation {stored[0]['spec']['pool']['generation']})")
            classes = deviceclasses.all_classes(driver)
            taken: set[str] = set()
            prepared: list[Claim] = []
            rootfs = busybox_rootfs(work) if why_not is None else None
            for name, what, spec in CLAIMS:
                spec = _fill(spec, driver)
                choices = allocate(spec, inventory, classes, driver, taken)
                results = allocation_results(choices, driver, node)
                taken |= {r["device"] for r in results}
                claim = Claim("default", name, str(uuid.uuid4()))
                api.put_claim(claim_allocated(claim.namespace, claim.name, claim.uid, results,
                                              allocation_config(spec, driver)))
                out(f"\n== claim {name}: {what}")
                out("   allocated: " + ", ".join(f"{r['request']} -> {r['device']}" for r in results))
                entry = kubelet.prepare([claim]).claims[claim.uid]
                if entry.error:
                    out(f"   prepare failed: {entry.error}")
                    continue
                prepared.append(claim)
                cdi_ids = [i for d in entry.devices for i in d.cdi_device_ids]
                out("   prepared: " + ", ".join(cdi_ids))
                if rootfs is not None:
                    seen = run_container(rootfs, cdi_ids, "env | grep '^DRA_\\|^NCCL' | sort; "
                                         "ls /dev/nvidia* /dev/infiniband/* /dev/dri/* 2>/dev/null; "
                                         "[ -x /usr/local/nvidia/bin/nvidia-smi ] && /usr/local/nvidia/bin/nvidia-smi; true")
                    out("   container saw:" if seen.returncode == 0 else f"   container failed: {seen.stderr.strip()}")
                    for line in seen.stdout.splitlines():
                        out(f"     {line}")
                else:
                    spec_file = next(cdi_root.glob(f"*{claim.uid}.json"))
                    edits = [d["containerEdits"] for d in json.loads(spec_file.read_text())["devices"]]
                    out(f"   (no container: {why_not}) CDI spec {spec_file.name}:")
                    for e in edits:
                        out(f"     nodes {[n['path'] for n in e.get('deviceNodes', [])]}")
            out("")
            for claim in prepared:
                kubelet.unprepare([claim])
            left = [p.name for p in cdi_root.glob(f"{driver}-claim_*.json")]
            out(f"== unprepared {len(prepared)} claims; CDI specs left: {len(left)}")
            kubelet.close()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(20)
            out(f"== driver stopped (exit {code}); {len(api.slices())} slices stay published for the next instance")
            return 0 if code == 0 and not left and len(prepared) == len(CLAIMS) else 1
        except Exception as err:
            out(f"demo failed: {err}; driver log: {log_file}")
            return 1
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None and proc.returncode == 0:
                shutil.rmtree(work, ignore_errors=True)


def _inventory_from_slices(stored: list[dict], driver: str) -> Inventory:
    """Devices as the scheduler sees them: from the published slices, not from discovery."""
    from driver.devices.model import Version

    devices = []
    for obj in stored:
        for d in obj["spec"]["devices"]:
            attrs = {}
            for key, value in d.get("attributes", {}).items():
                (kind, v), = value.items()
                attrs[key] = Version(v) if kind == "version" else v
            kind = DeviceKind(attrs["type"])
            devices.append(Device(d["name"], kind, attrs,
                                  {k: c["value"] for k, c in d.get("capacity", {}).items()}))
    return Inventory(tuple(devices))
