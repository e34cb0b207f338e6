"""FPGAs programmed at prepare (issue 43): the store's images read from their headers,
programming through the (mock) vendor tools that change the mock sysfs, refusals in one
line, the record written before the region changes, and crashes the next prepare repairs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from driver.devices import bitstreams, mock
from driver.devices.bitstreams import BitstreamError, BitstreamStore
from driver.devices.discovery import discover
from driver.devices.fpga import loaded_function
from driver.devices.fpgatools import ToolProgrammer
from driver.devices.mock import fpgatools
from driver.devices.mock.profile import builtin_profiles  # noqa: F401 - the profiles exist
from driver.devices.mock.tree import BITSTREAMS, FPGA_TOOLS
from driver.prepare import opaque
from driver.prepare.fpgaprogram import LOADED, PROGRAMMING, FpgaProgramError, FpgaPrograms, FpgaRecords
from driver.state.instance import Instance

ALVEO = "fpga-0000-31-00-1"  # the mixed profile's U250
DFL = "fpga-0000-32-00-0-port0"  # its D5005


@pytest.fixture
def node(tmp_path):
    built = mock.build(mock.load("mixed"), tmp_path / "m")
    instance = Instance.register(tmp_path / "state", None)
    yield built, instance
    instance.release()


def programs(built, instance, tmp_path, timeout: float = 30.0, store: Path | None = None) -> FpgaPrograms:
    boot = (built.proc / "sys/kernel/random/boot_id").read_text().strip()
    return FpgaPrograms(FpgaRecords(tmp_path / "state", instance),
                        BitstreamStore(store or built.root / BITSTREAMS),
                        ToolProgrammer(built.root / FPGA_TOOLS), built.sysfs, boot, timeout)


def device(built, name):
    return discover(built.sources()).inventory.get(name)


def config(function: str, digest: str | None = None) -> opaque.FpgaConfig:
    params = {"apiVersion": opaque.API_VERSION, "kind": "FpgaConfig", "function": function}
    if digest:
        params["digest"] = digest
    config = opaque.decode(params)
    assert isinstance(config, opaque.FpgaConfig)
    return config


# -- formats ------------------------------------------------------------------------------------
def test_xclbin_and_gbs_headers_are_read_from_the_files(tmp_path):
    x = tmp_path / "a.xclbin"
    x.write_bytes(fpgatools.xclbin("1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d",
                                   "bcb4e605-a501-55d4-a198-ec86ce02d0cd", "xilinx_u250_shell", b"BITS"))
    image = bitstreams.read(x)
    assert (image.family, image.interface, image.function, image.name) == (
        "alveo", "1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d", "bcb4e605-a501-55d4-a198-ec86ce02d0cd",
        "xilinx_u250_shell")
    assert x.read_bytes()[image.payload[0]:][:4] == b"BITS"
    g = tmp_path / "a.gbs"
    g.write_bytes(fpgatools.gbs("f3c99413-50f5-5b4a-896b-a05c1c5d6c42",
                                "D8424DC4-A4A3-C413-F89E-433683F9040B", "nlb0"))
    image = bitstreams.read(g)
    assert (image.family, image.interface, image.function) == (
        "dfl", "f3c99413-50f5-5b4a-896b-a05c1c5d6c42", "d8424dc4-a4a3-c413-f89e-433683f9040b")


@pytest.mark.parametrize("name,data,said", [
    ("x.xclbin", b"xclbin0\0" + b"\0" * 600, "not an xclbin"),
    ("x.xclbin", fpgatools.xclbin("1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d",
                                  "bcb4e605-a501-55d4-a198-ec86ce02d0cd", "v")[:500], "truncated"),
    ("x.gbs", b"\0" * 40, "not a GBS"),
    ("x.gbs", bitstreams.GBS_GUID.bytes + b"\x05\0\0\0{bad}" + b"\0" * 8, "GBS metadata lacks"),
])
def test_a_file_that_is_not_a_bitstream_is_named_in_one_line(tmp_path, name, data, said):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(BitstreamError) as err:
        bitstreams.read(path)
    assert said in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_function_and_digest_are_decoded_strictly():
    assert config("BCB4E605A50155D4A198EC86CE02D0CD").function == "bcb4e605-a501-55d4-a198-ec86ce02d0cd"
    for params, said in (({"function": "vadd"}, "is not a UUID"),
                         ({"digest": "sha256:" + "0" * 64}, "digest needs function"),
                         ({"function": "bcb4e605-a501-55d4-a198-ec86ce02d0cd", "digest": "md5:1"},
                          "must be sha256:")):
        with pytest.raises(opaque.ConfigDecodeError, match=said):
            opaque.decode({"apiVersion": opaque.API_VERSION, "kind": "FpgaConfig", **params})


# -- programming ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,model,attribute", [(ALVEO, "u250", "logicUUID"), (DFL, "d5005", "afuID")])
def test_the_function_is_loaded_through_the_tool_and_recorded(node, tmp_path, name, model, attribute):
    built, instance = node
    fpga = programs(built, instance, tmp_path)
    function = fpgatools.function_id("vadd", model)
    dev = device(built, name)
    assert bitstreams.canonical_uuid(str(dev.attributes[attribute])) != function
    programmed = fpga.ensure("ns/c", dev, config(function))
    assert loaded_function(built.sysfs, dev)[1] == function, "the mock sysfs changed"
    assert bitstreams.canonical_uuid(str(programmed.attributes[attribute])) == function
    assert bitstreams.canonical_uuid(str(device(built, name).attributes[attribute])) == function, \
        "rediscovery publishes it, so claims can select the programmed FPGA"
    record = fpga.records.get(name)
    assert (record.state, record.function, record.claim) == (LOADED, function, "ns/c")


def test_a_loaded_function_is_not_programmed_again(node, tmp_path):
    built, instance = node
    fpga = programs(built, instance, tmp_path)
    function = fpgatools.function_id("vadd", "u250")
    fpga.ensure("ns/a", device(built, ALVEO), config(function))
    # Without its tools the node could not program anything: the second claim needs none.
    (built.root / FPGA_TOOLS / "xbutil").unlink()
    fpga.ensure("ns/b", device(built, ALVEO), config(function))
    assert fpga.records.get(ALVEO).claim == "ns/a", "no new programming was recorded"


def test_wrong_shell_unknown_function_and_digest_are_refused_in_one_line(node, tmp_path):
    built, instance = node
    fpga = programs(built, instance, tmp_path)
    dev = device(built, ALVEO)
    before = loaded_function(built.sysfs, dev)[1]
    other = fpgatools.function_id("vadd", "u55c")  # built for the U55C's shell
    with pytest.raises(FpgaProgramError) as err:
        fpga.ensure("ns/c", dev, config(other))
    said = str(err.value)
    assert f"claim ns/c: FPGA {ALVEO}" in said and "97088961-feae-da91-52a2-1d9dfd63ccef" in said \
        and "1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d" in said and "\n" not in said
    with pytest.raises(FpgaProgramError, match=f"no bitstream for function {'0' * 8}-.* in the store"):
        fpga.ensure("ns/c", dev, config("00000000-0000-0000-0000-000000000001"))
    with pytest.raises(FpgaProgramError, match="has digest sha256:.*the claim asks for sha256:0000"):
        fpga.ensure("ns/c", dev, config(fpgatools.function_id("vadd", "u250"), "sha256:" + "0" * 64))
    assert loaded_function(built.sysfs, dev)[1] == before and fpga.records.all_or_errors() == [], \
        "nothing was recorded or changed"


def test_the_right_digest_is_accepted(node, tmp_path):
    built, instance = node
    fpga = programs(built, instance, tmp_path)
    function = fpgatools.function_id("vadd", "u250")
    image = next(b for b in BitstreamStore(built.root / BITSTREAMS).scan()[0] if b.function == function)
    fpga.ensure("ns/c", device(built, ALVEO), config(function, image.digest()))
    assert fpga.records.get(ALVEO).digest == image.digest()


def test_a_failed_download_leaves_a_record_that_makes_the_next_claim_reprogram(node, tmp_path):
    built, instance = node
    fpga = programs(built, instance, tmp_path)
    with pytest.raises(FpgaProgramError) as err:
        fpga.ensure("ns/a", device(built, DFL), config(fpgatools.function_id("broken", "d5005")))
    assert "fpgaconf exited with 1" in str(err.value) and "download failed" in str(err.value)
    assert fpga.records.get(DFL).state == PROGRAMMING
    vadd = fpgatools.function_id("vadd", "d5005")
    fpga.ensure("ns/b", device(built, DFL), config(vadd))
    assert loaded_function(built.sysfs, device(built, DFL))[1] == vadd
    assert fpga.records.get(DFL).state == LOADED


def test_a_download_past_the_budget_is_stopped(node, tmp_path):
    built, instance = node
    fpga = programs(built, instance, tmp_path, timeout=1.0)
    with pytest.raises(FpgaProgramError, match="ran longer than 1 s and was stopped"):
        fpga.ensure("ns/a", device(built, ALVEO), config(fpgatools.function_id("slow", "u250")))
    assert loaded_function(built.sysfs, device(built, ALVEO))[1] is None, "the region was cleared"
    assert fpga.records.get(ALVEO).state == PROGRAMMING


def test_a_device_held_by_another_claim_is_not_reprogrammed(node, tmp_path):
    built, instance = node
    fpga = programs(built, instance, tmp_path)
    with pytest.raises(FpgaProgramError, match="in use by claim\\(s\\) ns/monitor"):
        fpga.ensure("ns/c", device(built, ALVEO), config(fpgatools.function_id("vadd", "u250")),
                    holders=["ns/monitor"])


# -- crashes ----------------------------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from driver.devices import mock
    from driver.devices.discovery import discover
    from driver.devices.bitstreams import BitstreamStore
    from driver.devices.fpgatools import ToolProgrammer
    from driver.prepare import opaque
    from driver.prepare.fpgaprogram import FpgaPrograms, FpgaRecords
    from driver.state.instance import Instance
    root, state, name, function = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    built = mock.attach(mock.load("mixed"), root)
    instance = Instance.register(state, None)
    boot = (built.proc / "sys/kernel/random/boot_id").read_text().strip()
    fpga = FpgaPrograms(FpgaRecords(state, instance), BitstreamStore(root / "bitstreams"),
                        ToolProgrammer(root / "fpga-tools"), built.sysfs, boot, 30)
    config = opaque.decode({"apiVersion": opaque.API_VERSION, "kind": "FpgaConfig", "function": function})
    fpga.ensure("ns/a", discover(built.sources()).inventory.get(name), config)
""")


def test_sigkill_during_programming_is_repaired_by_the_next_prepare(node, tmp_path):
    """The driver (and its tool) killed in the middle of a download: the record says
    "programming", the region is cleared; the next prepare of a claim programs it."""
    built, instance = node
    slow = fpgatools.function_id("slow", "u250")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(built.root), str(tmp_path / "state"),
                              ALVEO, slow], start_new_session=True)
    records = FpgaRecords(tmp_path / "state", instance)
    deadline = time.monotonic() + 60
    while records.get(ALVEO) is None or loaded_function(built.sysfs, device(built, ALVEO))[1] is not None:
        assert child.poll() is None and time.monotonic() < deadline, "the child never started programming"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert records.get(ALVEO).state == PROGRAMMING
    # As outside a container: the tool (its own session) outlives the driver, still
    # downloading, and would overwrite the region when it finishes.
    assert running_tools(built.root / BITSTREAMS / "*" / "slow-u250.xclbin"), "the orphan tool runs"
    fpga = programs(built, instance, tmp_path)
    vadd = fpgatools.function_id("vadd", "u250")
    fpga.ensure("ns/b", device(built, ALVEO), config(vadd))
    assert running_tools(built.root / BITSTREAMS / "*" / "slow-u250.xclbin") == [], \
        "the cut-short programming's tool was stopped before the device was programmed again"
    assert loaded_function(built.sysfs, device(built, ALVEO))[1] == vadd
    assert records.get(ALVEO).state == LOADED and records.get(ALVEO).tool is None, "no tool runs"


def running_tools(image: Path) -> list[int]:
    """PIDs of live processes whose command line names a file matching `image`."""
    import fnmatch

    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and any(fnmatch.fnmatch(a, str(image)) for a in argv):
            found.append(int(proc.name))
    return found


@pytest.mark.parametrize("shown", ["target", "old", "empty"])
def test_every_crash_point_is_reprogrammed(node, tmp_path, shown):
    """The states a kill can leave, built exactly: a "programming" record with the region
    still old (killed before the tool), cleared (during it) or showing the function (after
    the tool, before the record said "loaded"). None is trusted: the retry programs."""
    built, instance = node
    fpga = programs(built, instance, tmp_path)
    dev = device(built, ALVEO)
    vadd = fpgatools.function_id("vadd", "u250")
    path, _ = loaded_function(built.sysfs, dev)
    if shown != "old":
        path.write_text((vadd if shown == "target" else "") + "\n")
    fpga.records.put(fpgaprogram_record(vadd, fpga.boot_id))
    (built.root / FPGA_TOOLS / "xbutil").unlink()  # so that a reprogramming shows as a failure
    with pytest.raises(FpgaProgramError, match="xbutil not found"):
        fpga.ensure("ns/a", dev, config(vadd))
    mock.build(mock.load("mixed"), built.root)  # the tools back (the card keeps its state)
    fpga.ensure("ns/a", device(built, ALVEO), config(vadd))
    assert fpga.records.get(ALVEO).state == LOADED and loaded_function(built.sysfs, dev)[1] == vadd


def test_records_of_an_earlier_boot_are_dropped(node, tmp_path):
    built, instance = node
    fpga = programs(built, instance, tmp_path)
    fpga.records.put(fpgaprogram_record(fpgatools.function_id("vadd", "u250"), "another-boot"))
    assert fpga.reconcile([]) == [] and fpga.records.get(ALVEO) is None


def fpgaprogram_record(function: str, boot: str):
    from driver.prepare.fpgaprogram import FpgaRecord
    return FpgaRecord(ALVEO, function, "x.xclbin", None, boot, PROGRAMMING, "ns/a")


# -- the driver process ------------------------------------------------------------------------------
def test_a_claim_naming_a_function_gets_it_loaded_and_a_wrong_one_fails_in_one_line():
    import json
    import uuid as uuidlib

    from driver.sim.apiserver import ApiServer, claim_allocated
    from driver.sim.kubelet import Claim
    from tests.driverproc import DRIVER, DriverDirs, DriverProcess

    dirs = DriverDirs.make()
    proc = None
    try:
        with ApiServer() as api:
            api.add_node("node-a")
            proc = DriverProcess(api, dirs, profile="mixed").start()
            kubelet = proc.kubelet()
            assert api.wait_for(lambda: len(api.state.slices) >= 1)

            def claim(name: str, function: str) -> Claim:
                uid = str(uuidlib.uuid4())
                api.put_claim(claim_allocated("default", name, uid, [
                    {"request": "fpga", "driver": DRIVER, "pool": "node-a", "device": ALVEO}],
                    [{"source": "FromClaim", "requests": ["fpga"], "opaque": {"driver": DRIVER, "parameters": {
                        "apiVersion": opaque.API_VERSION, "kind": "FpgaConfig", "function": function}}}]))
                return Claim("default", name, uid)

            wrong = claim("wrong", fpgatools.function_id("vadd", "u55c"))
            error = kubelet.prepare([wrong]).claims[wrong.uid].error
            assert "is built for interface 97088961" in error and "\n" not in error, error
            vadd = fpgatools.function_id("vadd", "u250")
            good = claim("good", vadd)
            assert kubelet.prepare([good]).claims[good.uid].error == ""
            spec = json.loads((dirs.cdi / f"{DRIVER}-claim_{good.uid}.json").read_text())
            nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
            assert not any("xclmgmt" in n for n in nodes), "no management access needed"
            env = spec["devices"][0]["containerEdits"]["env"]
            assert f"DRA_{ALVEO.upper().replace('-', '_')}_FUNCTION_ID={vadd}" in env, \
                "the container is told the function its FPGA holds (as sysfs shows it after the load)"
            logic = dirs.state / "mock" / "sys" / "bus" / "pci" / "devices" / "0000:31:00.1" / "logic_uuids"
            assert bitstreams.canonical_uuid(logic.read_text()) == vadd
            assert kubelet.unprepare([good]).claims[good.uid].error == ""
            assert bitstreams.canonical_uuid(logic.read_text()) == vadd, "kept loaded for reuse"
    finally:
        if proc is not None:
            proc.kill()
        dirs.cleanup()
