"""FPGAs programmed for the pod on the real cluster (issue 43): the store comes in through
the chart's value (fpga.bitstreams.hostPath -> the DaemonSet's FPGA_BITSTREAMS and a
read-only mount at the node's own path, in the chart's pod), the real kubelet prepares,
the driver loads the claim's xclbin through the mock node's xbutil, and containerd starts
the container, which checks the function it got. A claim whose function the store holds
only for another shell, or not at all, fails its pod's prepare with our one line in the
FailedPrepareDynamicResources event. The fast tests cover the same paths on the API
emulator (tests/test_fpga_programming.py)."""

from __future__ import annotations

import json
import re

import pytest

from driver.devices.mock import catalog, fpgatools
from tests.cluster.driverhost import DRIVER
from tests.cluster.driverpod import PodDriver
from tests.cluster.workloads import apply, events, get, namespace, pod, slice_device, wait
from tests.conftest import REPO

U250_SHELL = catalog.ALVEO["u250"].interface_uuid
U55C_SHELL = catalog.ALVEO["u55c"].interface_uuid
VADD_U250 = fpgatools.function_id("vadd", "u250")  # what examples/fpga-programmed names
VADD_U55C = fpgatools.function_id("vadd", "u55c")
UNKNOWN = "00000000-0000-0000-0000-000000000001"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The node's store as an operator fills it: one xclbin per shell, headers as XRT's."""
    root = tmp_path_factory.mktemp("bitstreams")
    for shell, function, model in ((U250_SHELL, VADD_U250, "u250"), (U55C_SHELL, VADD_U55C, "u55c")):
        (root / shell).mkdir()
        (root / shell / f"vadd-{model}.xclbin").write_bytes(
            fpgatools.xclbin(shell, function, catalog.ALVEO[model].vbnv))
    return root


@pytest.fixture(scope="module")
def driver(cluster, store, driver_image):
    drv = PodDriver(cluster, driver_image).install(
        profile="alveo", values={"fpga": {"bitstreams": {"hostPath": str(store)}}})
    assert drv.env()["FPGA_BITSTREAMS"] == str(store), "the chart passes the store to the driver"
    restarts = drv.restarts()
    yield drv
    assert drv.restarts() == restarts, drv.describe()


def test_the_pod_starts_with_the_function_its_claim_names_loaded(cluster, driver):
    ns = namespace(cluster, "fpga-prog")
    manifest = (REPO / "examples" / "fpga-programmed" / "claim.yaml").read_text()
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=manifest)
    done = wait("pod fpga-programmed finished",
                lambda: (p := get(cluster, ns, "pod", "fpga-programmed")) and
                p.get("status", {}).get("phase") in ("Succeeded", "Failed") and p, 150,
                explain=lambda: f"\nevents:\n{events(cluster, ns)}\ndriver:\n{driver.log()[-3000:]}")
    logs = cluster.kubectl("logs", "-n", ns, "fpga-programmed", check=False).stdout
    assert done["status"]["phase"] == "Succeeded", f"{done['status']}\n{logs}"
    # checked inside the container: the variable the driver set from the card's sysfs
    assert re.search(rf"^DRA_FPGA_\w+_FUNCTION_ID={VADD_U250}$", logs, re.M) and "vadd loaded" in logs, logs
    # loaded by this driver from the chart's store (not found already loaded)
    programmed = [json.loads(line) for line in driver.log().splitlines() if '"fpga_programmed"' in line]
    assert len(programmed) == 1 and programmed[0]["bitstream"].startswith(str(driver.env()["FPGA_BITSTREAMS"])), \
        driver.log()[-3000:]
    # and published: a later claim can select the programmed FPGA by attribute
    device = programmed[0]["device"]
    wait(f"{device} publishes logicUUID {VADD_U250}",
         lambda: (slice_device(cluster, device)["attributes"].get("logicUUID") or {}).get("string", "")
         .replace("-", "").lower() == VADD_U250.replace("-", ""), 60)
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def fpga_claim(name: str, function: str) -> dict:
    """A U250 (by its shell) whose FpgaConfig names `function`."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {
                "requests": [{"name": "dev", "exactly": {
                    "deviceClassName": f"fpga.{DRIVER}",
                    "selectors": [{"cel": {"expression":
                                           f'device.attributes["{DRIVER}"].interfaceID == "{U250_SHELL}"'}}]}}],
                "config": [{"opaque": {"driver": DRIVER, "parameters": {
                    "apiVersion": "accel.dra.io/v1alpha1", "kind": "FpgaConfig", "function": function}}}]}}}


def test_a_wrong_shell_or_unknown_bitstream_fails_the_claim_with_one_line(cluster, driver, store):
    ns = namespace(cluster, "fpga-bad")
    apply(cluster, ns, fpga_claim("wrong-shell", VADD_U55C), fpga_claim("unknown", UNKNOWN),
          pod("wrong-shell-pod", "wrong-shell"), pod("unknown-pod", "unknown"))
    expected = {
        "wrong-shell": re.compile(rf"claim {ns}/wrong-shell: FPGA fpga-\S+: bitstream for function {VADD_U55C} "
                                  rf"is built for interface {U55C_SHELL} \(vadd-u55c.xclbin\); the device's "
                                  rf"shell is interface {U250_SHELL}"),
        "unknown": re.compile(rf"claim {ns}/unknown: FPGA fpga-\S+: no bitstream for function {UNKNOWN} "
                              rf"in the store {re.escape(str(store))}"),
    }
    for name, line in expected.items():
        wait(f"pod {name}-pod fails to prepare with our line",
             lambda: line.search(events(cluster, ns)), 120,
             explain=lambda: f"\nevents:\n{events(cluster, ns)}\ndriver:\n{driver.log()[-3000:]}")
        assert (get(cluster, ns, "pod", f"{name}-pod") or {}).get("status", {}).get("phase") == "Pending"
    assert "FailedPrepareDynamicResources" in events(cluster, ns)
    failed = [line for line in driver.log().splitlines() if '"claim_failed"' in line and ns in line]
    assert failed and all("Traceback" not in line for line in failed), driver.log()[-3000:]
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
