"""FPGAs programmed at prepare (issue 43, docs/fpga.md): a prepare whose claim names a
function the FPGA does not hold (the mock node's xbutil reads the xclbin and changes the
mock sysfs; no card time), one whose function is loaded already, and a plain FPGA prepare
of the same run, which both are compared with."""

from __future__ import annotations

import time
import uuid

from bench.harness import DRIVER, NODE, Driver, wait
from bench.table import Table
from driver.devices.mock import catalog, fpgatools
from driver.sim.apiserver import ApiServer, claim_allocated
from driver.sim.kubelet import Claim, FakeKubelet

FUNCTION = fpgatools.function_id("vadd", "u250")
OTHER = "6c7966df-2f9e-5193-abe0-b39d815644ef"  # what another tenant left loaded


def _claim(api: ApiServer, device: str, function: str | None) -> Claim:
    uid = str(uuid.uuid4())
    name = f"f-{uid[:8]}"
    config = None if function is None else [{"source": "FromClaim", "requests": ["r"], "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": "accel.dra.io/v1alpha1", "kind": "FpgaConfig",
                                         "function": function}}}]
    api.put_claim(claim_allocated("default", name, uid, [
        {"request": "r", "driver": DRIVER, "pool": NODE, "device": device}], config))
    return Claim("default", name, uid)


def _prepare(api: ApiServer, kubelet: FakeKubelet, device: str, function: str | None) -> float:
    claim = _claim(api, device, function)
    t = time.perf_counter()
    response = kubelet.prepare([claim], timeout=60)
    elapsed = time.perf_counter() - t
    assert response.claims[claim.uid].error == "", response
    kubelet.unprepare([claim], timeout=60)
    return elapsed


def bench_fpga(table: Table, rounds: int) -> None:
    with ApiServer() as api:
        api.add_node(NODE)
        driver = Driver(api, "alveo")
        driver.start()
        kubelet = driver.kubelet()
        wait(lambda: len(api.state.slices) >= 1)
        shell = catalog.ALVEO["u250"].interface_uuid
        (device, *_) = sorted(d["name"] for s in api.slices() for d in s["spec"].get("devices") or []
                              if (d.get("attributes") or {}).get("interfaceID", {}).get("string") == shell)
        bdf = device.removeprefix("fpga-")
        bdf = f"{bdf[:4]}:{bdf[5:7]}:{bdf[8:10]}.{bdf[11:]}"
        logic = driver.dir / "state" / "mock" / "sys" / "bus" / "pci" / "devices" / bdf / "logic_uuids"
        plain, loaded, programmed = [], [], []
        for _ in range(rounds):
            logic.write_text(OTHER + "\n")  # the card holds another function: a download is due
            programmed.append(_prepare(api, kubelet, device, FUNCTION))
            loaded.append(_prepare(api, kubelet, device, FUNCTION))
            plain.append(_prepare(api, kubelet, device, None))
        base = table.latency("fpga: prepare of an FPGA, no function named", plain)
        skip = table.latency("fpga: prepare, the function already loaded (skipped)", loaded)
        load = table.latency("fpga: prepare loading the function (mock xbutil)", programmed,
                             "a Python process start; a real download adds the card's seconds")
        table.value("fpga: already loaded / no function", f"{skip / base:.2f}x")
        table.value("fpga: loading / no function", f"{load / base:.1f}x")
        kubelet.close()
        driver.stop()
